"""KL estimators between the policy and a frozen reference, per token.

With ``log r = logp - ref_logp`` (policy over reference, at the sampled token), the
estimators of KL(policy || reference) from samples of the policy are (Schulman, "Approximating
KL Divergence", 2020; verl's ``kl_penalty`` names in brackets):

* ``k1`` [kl]:          ``log r``                    (unbiased, high variance, can be < 0)
* ``k2`` [mse]:         ``(log r)^2 / 2``            (biased, >= 0)
* ``k3``:               ``exp(-log r) - 1 + log r``  (unbiased, >= 0)
* ``low_var_kl``:       ``k3`` with ``log r`` and the result clamped to [-20, 20] and
  [-10, 10], as verl's ``low_var_kl`` does against overflow on far-off tokens.

All are differentiable w.r.t. ``logprobs`` (the reference is constant); as a loss term they
are aggregated like the policy loss and weighted by ``--kl-coef``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "kl_per_token"]

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "low_var_kl"
                 ) -> Tensor:
    """Per-token KL(policy || reference) estimate [T] of ``estimator``."""
    log_ratio = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {list(KL_ESTIMATORS)}")
