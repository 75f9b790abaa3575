"""Per-token policy losses (PPO / Clip-Higher, GPPO, CISPO), SFT loss and token-level aggregation.

Everything here works on flat per-token tensors ``[T]`` (log-probs of the sampled tokens under
the current and the behaviour policy, advantages broadcast to tokens, a 0/1 loss mask). These
are the pure-torch specification of the per-token math; the fused vocab-parallel op in
:mod:`megatron_klear.ops` computes the log-probs and reuses (or re-implements in C++/CUDA and is
tested against) the functions below.

Losses are *minimised*. ``r = exp(logp - old_logp)``, ``A`` the advantage, ``sg`` stop-gradient.
The clip cases (see docs/ARCHITECTURE.md, GPPO table):

* low:  ``A < 0 and r < 1 - eps_low``
* high: ``A > 0 and r > 1 + eps_high``
* dual: ``A < 0`` and the loss above exceeds ``-dual_clip * A`` (optional, ``dual_clip > 1``)

PPO gives these tokens the clipped value and **zero** gradient; GPPO (CE-GPPO's general-beta
form, Klear's ``compute_gppo_loss_general_beta``) gives them the value AND the gradient
``-beta * bound * A`` through ``beta * bound / sg(r) * r``; the dual clip caps the loss of
``A < 0`` tokens at the constant ``-c A`` (zero gradient) in both, i.e. ``min(-c A, loss)`` as
in the official code (for ``beta1 (1 - eps_low) <= c``, the usual setting, this is ``r > c``).
CISPO uses ``-sg(clip(r)) * A * logp``.

Entropy-ratio clipping (ERC, arXiv 2512.05591) works on top of any of them: with
``rho = (H + 1e-8) / (H_old + 1e-8)`` from the full-vocabulary entropies of the current and the
behaviour policy at each token, tokens outside ``1 - delta < rho < 1 + delta`` keep their loss
value but pass no gradient (``m l + (1 - m) sg(l)``); the entropies are not differentiated.

Aggregation is token-level: ``sum(per_token * mask) / normalizer`` where ``normalizer`` is the
token count of the WHOLE mini-batch (all micro-batches, all data-parallel ranks), so that the
summed gradient does not depend on how the mini-batch is split. Sum (not average) the
micro-batch and data-parallel gradients when using an explicit normalizer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["POLICY_LOSSES", "register_policy_loss", "per_token_policy_loss", "policy_loss",
           "policy_metrics", "clip_cases", "check_loss_args", "entropy_ratio", "entropy_ratio_mask",
           "erc_metrics", "sft_loss", "aggregate", "masked_mean", "global_token_count"]

PerTokenLoss = Callable[..., Tensor]
POLICY_LOSSES: dict[str, PerTokenLoss] = {}


def register_policy_loss(name: str) -> Callable[[PerTokenLoss], PerTokenLoss]:
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, **hyper) -> Tensor[T]``."""
    def deco(fn: PerTokenLoss) -> PerTokenLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


ERC_EPS = 1e-8   # the 1e-8 of ERC's entropy ratio (both entropies)


class ClipCases(NamedTuple):
    """Boolean masks [T] of the low / high clip cases, plus the ratio (detached)."""

    ratio: Tensor
    low: Tensor
    high: Tensor


def check_loss_args(name: str, dual_clip: float | None,
                    entropy_ratio_clip: float | None = None) -> None:
    """Validate the loss name, the dual clip and the ERC delta (shared by every backend)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    if entropy_ratio_clip is not None and not entropy_ratio_clip > 0:
        raise ValueError(f"entropy_ratio_clip (ERC delta) must be > 0, e.g. 0.05 (got "
                         f"{entropy_ratio_clip}); pass None to disable it")
    if dual_clip is None:
        return
    if name == "cispo":
        raise ValueError("dual_clip applies to the ppo/gppo losses, not cispo; pass dual_clip=None")
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); pass None to disable it")


def clip_cases(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> ClipCases:
    """Classify tokens into the low / high clip cases of the GPPO table."""
    r = ratio.detach()
    low = (advantages < 0) & (r < 1.0 - eps_low)
    high = (advantages > 0) & (r > 1.0 + eps_high)
    return ClipCases(r, low, high)


def entropy_ratio(entropy: Tensor, old_entropy: Tensor) -> Tensor:
    """ERC's rho [T] = (H + 1e-8) / (H_old + 1e-8) in fp32, detached."""
    return (entropy.detach().float() + ERC_EPS) / (old_entropy.detach().float() + ERC_EPS)


def entropy_ratio_mask(entropy: Tensor, old_entropy: Tensor, delta: float) -> Tensor:
    """ERC's m [T] (bool): ``1 - delta < rho < 1 + delta``.

    torch compares fp32 with the bounds 1 -/+ delta computed in double and rounded to fp32, as
    the kernels' ``token_params`` does."""
    rho = entropy_ratio(entropy, old_entropy)
    return (rho > 1.0 - delta) & (rho < 1.0 + delta)


def _clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
                       eps_low: float, eps_high: float, beta1: float, beta2: float,
                       dual_clip: float | None, gradient_through_clip: bool) -> Tensor:
    """-r A inside the trust region; clipped value outside (with or without GPPO's gradient)."""
    ratio = torch.exp(logprobs - old_logprobs)
    cases = clip_cases(ratio, advantages, eps_low, eps_high)
    bound = torch.where(cases.low, 1.0 - eps_low, 1.0 + eps_high).to(ratio.dtype)
    if gradient_through_clip:   # GPPO: value -beta*bound*A, gradient -beta*bound*A wrt logp
        beta = torch.where(cases.low, beta1, beta2).to(ratio.dtype)
        clipped = -beta * bound / cases.ratio * ratio * advantages
    else:                       # PPO: value -bound*A, no gradient
        clipped = (-bound * advantages).detach()
    loss = torch.where(cases.low | cases.high, clipped, -ratio * advantages)
    if dual_clip is not None:   # min(-c A, loss) for A < 0, constant where it caps
        cap = (-dual_clip * advantages).detach()
        loss = torch.where((advantages < 0) & (loss.detach() > cap), cap, loss)
    return loss


@register_policy_loss("ppo")
def ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
             eps_high: float = 0.28, dual_clip: float | None = None, **_: float) -> Tensor:
    """PPO clipped surrogate with separate eps_low / eps_high (Clip-Higher); beta is unused."""
    return _clipped_surrogate(logprobs, old_logprobs, advantages, eps_low=eps_low,
                              eps_high=eps_high, beta1=1.0, beta2=1.0, dual_clip=dual_clip,
                              gradient_through_clip=False)


@register_policy_loss("gppo")
def gppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
              eps_high: float = 0.28, beta1: float = 1.0, beta2: float = 1.0,
              dual_clip: float | None = None) -> Tensor:
    """GPPO: PPO's clipped values with bounded gradients -beta*bound*A on clipped tokens."""
    return _clipped_surrogate(logprobs, old_logprobs, advantages, eps_low=eps_low,
                              eps_high=eps_high, beta1=beta1, beta2=beta2, dual_clip=dual_clip,
                              gradient_through_clip=True)


@register_policy_loss("cispo")
def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
               eps_high: float = 0.28, dual_clip: float | None = None, **_: float) -> Tensor:
    """CISPO: -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp (REINFORCE with clipped IS weight)."""
    check_loss_args("cispo", dual_clip)
    ratio = torch.exp(logprobs - old_logprobs).detach()
    return -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages * logprobs


def per_token_policy_loss(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                          *, entropy: Tensor | None = None, old_entropy: Tensor | None = None,
                          entropy_ratio_clip: float | None = None, **kw: float | None) -> Tensor:
    """Per-token loss [T] of the registered loss ``name`` (differentiable w.r.t. logprobs).

    With ``entropy_ratio_clip`` (ERC's delta) the tokens whose entropy ratio ``entropy /
    old_entropy`` (current / behaviour policy, full vocabulary, per token) leaves
    ``(1 - delta, 1 + delta)`` keep their value and lose their gradient.
    """
    check_loss_args(name, kw.get("dual_clip"), entropy_ratio_clip)
    loss = POLICY_LOSSES[name](logprobs, old_logprobs, advantages, **kw)
    if entropy_ratio_clip is None:
        return loss
    if entropy is None or old_entropy is None:
        raise ValueError("entropy_ratio_clip needs the per-token entropy of the current policy "
                         "and old_entropy of the behaviour policy")
    keep = entropy_ratio_mask(entropy, old_entropy, entropy_ratio_clip)
    return torch.where(keep, loss, loss.detach())   # m l + (1 - m) sg(l)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty)."""
    mask = mask.to(torch.bool)
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def aggregate(per_token: Tensor, loss_mask: Tensor, normalizer: float | Tensor | None = None
              ) -> Tensor:
    """Token-level aggregation: sum(per_token over mask) / normalizer (default: mask.sum()).

    An all-masked batch (or a zero normalizer) gives 0 with a zero, finite gradient.
    """
    mask = loss_mask.to(torch.bool)
    total = torch.where(mask, per_token, 0).sum()
    if normalizer is None:
        normalizer = mask.sum()
    normalizer = torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    return total / normalizer.clamp(min=1)


def sft_loss(logprobs: Tensor, loss_mask: Tensor, normalizer: float | Tensor | None = None
             ) -> Tensor:
    """SFT (NLL) loss: -sum(logprobs over mask) / normalizer (token-level, as :func:`aggregate`)."""
    return aggregate(-logprobs, loss_mask, normalizer)


def policy_metrics(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                   *, eps_low: float = 0.2, eps_high: float = 0.28) -> dict[str, Tensor]:
    """Masked-mean diagnostics: clip fractions (low/high), mean ratio, approximate KL.

    ``approx_kl`` is the k3 estimator ``r - 1 - log r`` of KL(old || new) (non-negative).
    """
    with torch.no_grad():
        log_ratio = (logprobs - old_logprobs).float()
        ratio = torch.exp(log_ratio)
        cases = clip_cases(ratio, advantages, eps_low, eps_high)
        return {"clipfrac_low": masked_mean(cases.low.float(), loss_mask),
                "clipfrac_high": masked_mean(cases.high.float(), loss_mask),
                "ratio_mean": masked_mean(ratio, loss_mask),
                "approx_kl": masked_mean(ratio - 1 - log_ratio, loss_mask)}


def erc_metrics(entropy: Tensor, old_entropy: Tensor, delta: float, loss_mask: Tensor
                ) -> dict[str, Tensor]:
    """ERC diagnostics: fraction of masked tokens whose gradient ERC removes, mean entropy
    ratio."""
    keep = entropy_ratio_mask(entropy, old_entropy, delta)
    return {"erc_clipfrac": masked_mean((~keep).float(), loss_mask),
            "entropy_ratio_mean": masked_mean(entropy_ratio(entropy, old_entropy), loss_mask)}


def policy_loss(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                loss_mask: Tensor, *, eps_low: float = 0.2, eps_high: float = 0.28,
                beta1: float = 1.0, beta2: float = 1.0, dual_clip: float | None = None,
                entropy: Tensor | None = None, old_entropy: Tensor | None = None,
                entropy_ratio_clip: float | None = None,
                normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level policy loss of ``name`` over the masked tokens, and its metrics."""
    per_token = per_token_policy_loss(name, logprobs, old_logprobs, advantages, eps_low=eps_low,
                                      eps_high=eps_high, beta1=beta1, beta2=beta2,
                                      dual_clip=dual_clip, entropy=entropy,
                                      old_entropy=old_entropy,
                                      entropy_ratio_clip=entropy_ratio_clip)
    metrics = policy_metrics(logprobs, old_logprobs, advantages, loss_mask, eps_low=eps_low,
                             eps_high=eps_high)
    if entropy_ratio_clip is not None:
        metrics.update(erc_metrics(entropy, old_entropy, entropy_ratio_clip, loss_mask))
    return aggregate(per_token, loss_mask, normalizer), metrics


def global_token_count(loss_masks: list[Tensor] | Tensor, group=None) -> Tensor:
    """Total masked-token count of a mini-batch: summed over micro-batches and the ``group``
    (the data-parallel group; None = this process only). Use it as ``normalizer``."""
    masks = [loss_masks] if isinstance(loss_masks, Tensor) else loss_masks
    count = sum(m.to(torch.float64).sum() for m in masks)
    count = torch.as_tensor(count, dtype=torch.float64)
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(count, group=group)
    return count
