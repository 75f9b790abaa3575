"""Rollout correction: importance weights for the mismatch between the rollout engine and the
trainer (``--rollout-correction``).

The rollout servers sample with their own kernels (SGLang; bf16, other reductions), so the
behaviour policy that produced a response, ``pi_rollout``, differs from the trainer's
``pi_old`` that PPO-style losses treat as behaviour policy. With ``d_t = old_logp_t -
rollout_logp_t`` over the response tokens of one sequence, the mismatch ratio at each level is

* ``token``:     ``rho_t = exp(d_t)``
* ``sequence``:  ``rho = exp(sum_t d_t)``   (the exact sequence-level IS ratio)
* ``geometric``: ``rho = exp(mean_t d_t)``  (its per-token geometric mean; low variance,
  length-independent, biased)

and every token of a sequence gets its sequence's ``rho`` at the last two levels. The weight
``w`` multiplies the token's policy loss (the trainer folds it into the advantage, which is the
same for gppo/ppo/cispo: ``w >= 0`` keeps each token's clip case):

* ``tis``    truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): ``w = min(rho, cap)``, cap default 2;
* ``mis``    masked IS (Liu et al. 2025, "When speed kills stability"): ``w = rho`` where
  ``lower <= rho <= cap``, else 0 (the token or whole sequence is rejected); cap default 2,
  no lower bound unless ``--rollout-correction-lower`` is given;
* ``icepop`` IcePop (Ling team, Ring-1T report, 2025): the same two-sided mask with IcePop's
  band ``[0.5, 5]`` by default (the paper's token level; other levels apply the band to the
  sequence / geometric ratio).

Rejected tokens contribute 0 to the loss but stay in the token-level normaliser (the MIS
estimator; verl's rejection sampling instead drops them from the denominator). The former
``--tis-cap C`` is the same as ``--rollout-correction tis --rollout-correction-level token
--rollout-correction-cap C``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MODES", "LEVELS", "RolloutCorrection", "rollout_correction_weights"]

MODES = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence", "geometric")
DEFAULT_CAP = {"tis": 2.0, "mis": 2.0, "icepop": 5.0}
DEFAULT_LOWER = {"tis": None, "mis": None, "icepop": 0.5}


@dataclass(frozen=True)
class RolloutCorrection:
    """One rollout-correction setting; ``cap`` / ``lower`` None take the mode's defaults.

    Raises ValueError naming the ``--rollout-correction*`` flag of a bad value."""

    mode: str
    level: str = "token"
    cap: float | None = None
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.mode == "none":
            raise ValueError(f"--rollout-correction {self.mode!r}: choose from tis, mis, icepop "
                             "(none disables it)")
        if self.level not in LEVELS:
            raise ValueError(f"--rollout-correction-level {self.level!r}: choose from "
                             f"{', '.join(LEVELS)}")
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"--rollout-correction-cap must be > 0 (got {self.cap})")
        if self.lower is not None and self.mode == "tis":
            raise ValueError("--rollout-correction-lower applies to mis and icepop (masks); tis "
                             "only truncates at --rollout-correction-cap")
        if self.lower is not None and not 0 <= self.lower < self.upper:
            raise ValueError(f"--rollout-correction-lower {self.lower} must be in [0, "
                             f"--rollout-correction-cap {self.upper})")

    @property
    def upper(self) -> float:
        """The cap in effect (truncation for tis, upper mask bound for mis/icepop)."""
        return DEFAULT_CAP[self.mode] if self.cap is None else self.cap

    @property
    def low(self) -> float | None:
        """The lower mask bound in effect (None: one-sided)."""
        return DEFAULT_LOWER[self.mode] if self.lower is None else self.lower


def _level_log_ratio(log_ratio: Tensor, mask: Tensor, sequence_ids: Tensor, level: str) -> Tensor:
    """Per-token log of rho at ``level`` (fp64): d_t, or its sum / mean over the sequence."""
    if level == "token" or log_ratio.numel() == 0:
        return log_ratio
    ids = sequence_ids.reshape(-1).long()
    n = ids.numel() + 1                  # ids < number of tokens: no device-to-host sync
    ids = torch.where(ids < 0, n - 1, ids)                  # padding (-1): its own bucket
    flat = (log_ratio * mask).reshape(-1)
    sums = torch.zeros(n, dtype=flat.dtype, device=flat.device).index_add_(0, ids, flat)
    if level == "geometric":
        counts = torch.zeros_like(sums).index_add_(0, ids, mask.reshape(-1))
        sums = sums / counts.clamp(min=1)
    return sums[ids].view_as(log_ratio)


def rollout_correction_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                               sequence_ids: Tensor, spec: RolloutCorrection
                               ) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights (fp32, shaped like the log-probs, 0 off the mask) and diagnostics.

    ``sequence_ids`` gives each token's sequence (any layout: the row of a padded batch, the
    ``segment_ids`` of a THD pack, -1 for pack padding); only masked (response) tokens enter a
    sequence's ratio. Diagnostics are masked means: ``weight_mean``, ``rejected_frac`` (tokens
    given weight 0 by mis/icepop), ``truncated_frac`` (tis tokens at the cap).
    """
    mask = loss_mask.to(torch.float64)
    d = (old_logprobs.detach().double() - rollout_logprobs.detach().double()) * mask
    log_rho = _level_log_ratio(d, mask, sequence_ids, spec.level)
    rho = torch.exp(log_rho)                                   # inf for huge sequence sums
    on = mask > 0
    if spec.mode == "tis":
        weights = rho.clamp(max=spec.upper)
        truncated, rejected = on & (rho > spec.upper), torch.zeros_like(on)
    else:
        keep = rho <= spec.upper
        if spec.low is not None:
            keep &= rho >= spec.low
        weights = torch.where(keep, rho, 0.0)                # no inf * 0
        truncated, rejected = torch.zeros_like(on), on & ~keep
    weights = torch.where(on, weights, 0.0).float()
    tokens = mask.sum().clamp(min=1)
    metrics = {"weight_mean": (weights.double() * mask).sum() / tokens,
               "rejected_frac": rejected.double().sum() / tokens,
               "truncated_frac": truncated.double().sum() / tokens}
    return weights, {k: v.float() for k, v in metrics.items()}
