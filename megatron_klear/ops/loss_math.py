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

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["POLICY_LOSSES", "register_policy_loss", "per_token_policy_loss", "policy_loss",
           "policy_metrics", "clip_cases", "check_loss_args", "entropy_ratio", "entropy_ratio_mask",
           "erc_metrics", "sft_loss", "aggregate", "masked_mean", "global_token_count",
           "erc_band", "LOSS_AGGREGATIONS", "AggregationTotals", "verl_masked_mean",
           "aggregate_rl_loss", "MicroCounts", "sequence_mean", "SEQUENCE_LOSSES",
           "PolicyLossSpec"]

PerTokenLoss = Callable[..., Tensor]
POLICY_LOSSES: dict[str, PerTokenLoss] = {}
SEQUENCE_LOSSES = ("gspo",)   # losses that also take sequence_ids and loss_mask


def register_policy_loss(name: str) -> Callable[[PerTokenLoss], PerTokenLoss]:
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, **hyper) -> Tensor[T]``."""
    def deco(fn: PerTokenLoss) -> PerTokenLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


ERC_EPS = 1e-8   # the 1e-8 of ERC's entropy ratio (both entropies)
ERC_MAX_LOG_RATIO = 20.0   # ERC's code clamps log r to [-20, 20] before exp


class ClipCases(NamedTuple):
    """Boolean masks [T] of the low / high clip cases, plus the ratio (detached)."""

    ratio: Tensor
    low: Tensor
    high: Tensor


def check_loss_args(name: str, dual_clip: float | None,
                    entropy_ratio_clip: float | None = None, erc_low: float | None = None,
                    erc_high: float | None = None) -> None:
    """Validate the loss name, the dual clip and the ERC band (shared by every backend)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSSES)}")
    erc_band(entropy_ratio_clip, erc_low, erc_high)
    if dual_clip is None:
        return
    if name in ("cispo", "gspo"):
        raise ValueError(f"dual_clip applies to the ppo/gppo losses, not {name}; pass "
                         "dual_clip=None")
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); pass None to disable it")


@dataclass(frozen=True)
class PolicyLossSpec:
    """The per-token policy loss's hyper-parameters in one record: the loss, its clip bounds
    and GPPO gradient weights, the dual clip and ERC's band (``entropy_ratio_clip`` = delta, or
    ``erc_low``/``erc_high``). Validated once when built, so a caller (the trainer's policy-loss
    section, a test, a benchmark) builds it once and hands it to every micro-batch's loss."""

    loss_type: str = "gppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta1: float = 1.0
    beta2: float = 1.0
    dual_clip: float | None = None
    entropy_ratio_clip: float | None = None
    erc_low: float | None = None
    erc_high: float | None = None

    def __post_init__(self) -> None:
        check_loss_args(self.loss_type, self.dual_clip, self.entropy_ratio_clip, self.erc_low,
                        self.erc_high)

    @property
    def band(self) -> tuple[float, float] | None:
        """ERC's band of the entropy ratio, or None when ERC is off (:func:`erc_band`)."""
        return erc_band(self.entropy_ratio_clip, self.erc_low, self.erc_high)


def clip_cases(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> ClipCases:
    """Classify tokens into the low / high clip cases of the GPPO table."""
    r = ratio.detach()
    low = (advantages < 0) & (r < 1.0 - eps_low)
    high = (advantages > 0) & (r > 1.0 + eps_high)
    return ClipCases(r, low, high)


def erc_band(delta: float | None, low: float | None = None, high: float | None = None
             ) -> tuple[float, float] | None:
    """ERC's band ``(low, high)`` of the entropy ratio: ``(1 - delta, 1 + delta)`` from the
    symmetric delta, or the two free bounds (ERC's scripts: 0.95 / 1.05); None when ERC is off.
    Raises ValueError on a bad or ambiguous band."""
    if delta is not None:
        if low is not None or high is not None:
            raise ValueError("give ERC's band as entropy_ratio_clip (delta) or as erc_low and "
                             "erc_high, not both")
        if not delta > 0:
            raise ValueError(f"entropy_ratio_clip (ERC delta) must be > 0, e.g. 0.05 (got "
                             f"{delta}); pass None to disable it")
        return 1.0 - delta, 1.0 + delta
    if low is None and high is None:
        return None
    if low is None or high is None or not 0 <= low < high:
        raise ValueError(f"erc_low and erc_high must both be given with 0 <= erc_low < erc_high "
                         f"(e.g. 0.95 and 1.05), got {low} and {high}")
    return float(low), float(high)


def entropy_ratio(entropy: Tensor, old_entropy: Tensor) -> Tensor:
    """ERC's rho [T] = (H + 1e-8) / (H_old + 1e-8) in the entropies' dtype, detached."""
    return (entropy.detach() + ERC_EPS) / (old_entropy.detach() + ERC_EPS)


def entropy_ratio_mask(entropy: Tensor, old_entropy: Tensor, delta: float | None = None, *,
                       low: float | None = None, high: float | None = None) -> Tensor:
    """ERC's m [T] (bool): ``low < rho < high`` (``1 -/+ delta`` from the delta).

    torch compares rho with the Python-float bounds rounded to rho's dtype, as the kernels'
    ``token_params`` rounds them to fp32."""
    low, high = erc_band(delta, low, high)
    rho = entropy_ratio(entropy, old_entropy)
    return (rho > low) & (rho < high)


def _ratio(logprobs: Tensor, old_logprobs: Tensor, max_log_ratio: float | None) -> Tensor:
    """r = exp(log r), with log r clamped to [-max, max] first when asked (ERC's code; the
    clamp passes no gradient outside the range)."""
    log_ratio = logprobs - old_logprobs
    if max_log_ratio is not None:
        log_ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(log_ratio)


def _per_case(low: Tensor, like: Tensor, value_low: float, value_high: float) -> Tensor:
    """``value_low`` where ``low`` else ``value_high``, as a tensor of ``like``'s dtype (a
    Python float rounded once to that dtype, as torch rounds a scalar operand: exact in any
    dtype; ``torch.where`` on two Python floats would give float32)."""
    return torch.where(low, like.new_tensor(value_low), like.new_tensor(value_high))


def _clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
                       eps_low: float, eps_high: float, beta1: float, beta2: float,
                       dual_clip: float | None, gradient_through_clip: bool,
                       max_log_ratio: float | None = None) -> Tensor:
    """-r A inside the trust region; clipped value outside (with or without GPPO's gradient).

    The clipped GPPO value is ``(-beta * bound) / sg(r) * r * A`` evaluated as Klear's
    ``compute_gppo_loss_general_beta`` evaluates it: ``-beta * bound`` formed in Python double,
    then (torch's Python-scalar division) ``reciprocal(sg(r)) * coef``, times r, times A."""
    ratio = _ratio(logprobs, old_logprobs, max_log_ratio)
    cases = clip_cases(ratio, advantages, eps_low, eps_high)
    if gradient_through_clip:   # GPPO: value -beta*bound*A, gradient -beta*bound*A wrt logp
        coef = _per_case(cases.low, ratio, -beta1 * (1.0 - eps_low), -beta2 * (1.0 + eps_high))
        clipped = cases.ratio.reciprocal() * coef * ratio * advantages
    else:                       # PPO: value -bound*A, no gradient
        bound = _per_case(cases.low, ratio, 1.0 - eps_low, 1.0 + eps_high)
        clipped = (-bound * advantages).detach()
    loss = torch.where(cases.low | cases.high, clipped, -ratio * advantages)
    if dual_clip is not None:   # min(-c A, loss) for A < 0, constant where it caps
        cap = (-dual_clip * advantages).detach()
        loss = torch.where((advantages < 0) & (loss.detach() > cap), cap, loss)
    return loss


@register_policy_loss("ppo")
def ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
             eps_high: float = 0.28, dual_clip: float | None = None,
             max_log_ratio: float | None = None, **_: float) -> Tensor:
    """PPO clipped surrogate with separate eps_low / eps_high (Clip-Higher); beta is unused."""
    return _clipped_surrogate(logprobs, old_logprobs, advantages, eps_low=eps_low,
                              eps_high=eps_high, beta1=1.0, beta2=1.0, dual_clip=dual_clip,
                              gradient_through_clip=False, max_log_ratio=max_log_ratio)


@register_policy_loss("gppo")
def gppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
              eps_high: float = 0.28, beta1: float = 1.0, beta2: float = 1.0,
              dual_clip: float | None = None, max_log_ratio: float | None = None) -> Tensor:
    """GPPO: PPO's clipped values with bounded gradients -beta*bound*A on clipped tokens."""
    return _clipped_surrogate(logprobs, old_logprobs, advantages, eps_low=eps_low,
                              eps_high=eps_high, beta1=beta1, beta2=beta2, dual_clip=dual_clip,
                              gradient_through_clip=True, max_log_ratio=max_log_ratio)


@register_policy_loss("cispo")
def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *, eps_low: float = 0.2,
               eps_high: float = 0.28, dual_clip: float | None = None,
               max_log_ratio: float | None = None, **_: float) -> Tensor:
    """CISPO: -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp (REINFORCE with clipped IS weight)."""
    check_loss_args("cispo", dual_clip)
    ratio = _ratio(logprobs, old_logprobs, max_log_ratio).detach()
    return -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages * logprobs


GSPO_MAX_LOG_RATIO = 10.0   # the sequence log-ratio cap of verl's GSPO loss


def sequence_mean(values: Tensor, sequence_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Each token's sequence mean of ``values`` over the masked tokens [T] (ids >= 0 on masked
    tokens; 0 where a token is masked out). No host sync: one slot per token bounds the ids."""
    mask = loss_mask.to(values.dtype)
    slots = values.numel()
    ids = torch.where(loss_mask.bool(), sequence_ids.long(), slots)  # masked out: a spare slot
    sums = values.new_zeros(slots + 1).index_add_(0, ids, values * mask)
    counts = values.new_zeros(slots + 1).index_add_(0, ids, mask)
    return (sums / counts.clamp(min=1))[ids] * mask


@register_policy_loss("gspo")
def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, *,
              sequence_ids: Tensor, loss_mask: Tensor, eps_low: float = 3e-4,
              eps_high: float = 4e-4, **_: float | None) -> Tensor:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), token-level form: the sequence ratio
    ``s_i = exp(mean over sequence i's response tokens of log r)`` (log capped at 10), per
    token ``s_i,t = sg(s_i) * r_t / sg(r_t)`` (value ``s_i``, gradient ``s_i`` w.r.t. logp_t),
    and PPO's clip on it: ``max(-s A, -clip(s, 1 - eps_low, 1 + eps_high) A)`` (GSPO's clip
    ranges are ~1e-4, not PPO's 0.2). ``sequence_ids``/``loss_mask`` [T] say which tokens form
    each sequence's response."""
    log_ratio = logprobs - old_logprobs
    seq_log = sequence_mean(log_ratio.detach(), sequence_ids, loss_mask)
    ratio = torch.exp((seq_log + log_ratio - log_ratio.detach()).clamp(max=GSPO_MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(-ratio * advantages, -clipped * advantages)


def per_token_policy_loss(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                          *, entropy: Tensor | None = None, old_entropy: Tensor | None = None,
                          entropy_ratio_clip: float | None = None, erc_low: float | None = None,
                          erc_high: float | None = None, **kw: float | None) -> Tensor:
    """Per-token loss [T] of the registered loss ``name`` (differentiable w.r.t. logprobs).

    With ERC (``entropy_ratio_clip`` = delta, or the band ``erc_low``/``erc_high``) the tokens
    whose entropy ratio ``entropy / old_entropy`` (current / behaviour policy, full
    vocabulary, per token) leaves the band keep their value and lose their gradient, and log r
    is clamped to [-20, 20] before exp, as ERC's ``compute_policy_loss_gppo_erc`` does.
    """
    check_loss_args(name, kw.get("dual_clip"), entropy_ratio_clip, erc_low, erc_high)
    band = erc_band(entropy_ratio_clip, erc_low, erc_high)
    if band is None:
        return POLICY_LOSSES[name](logprobs, old_logprobs, advantages, **kw)
    if entropy is None or old_entropy is None:
        raise ValueError("ERC (entropy_ratio_clip or erc_low/erc_high) needs the per-token "
                         "entropy of the current policy and old_entropy of the behaviour policy")
    loss = POLICY_LOSSES[name](logprobs, old_logprobs, advantages,
                               max_log_ratio=ERC_MAX_LOG_RATIO, **kw)
    keep = entropy_ratio_mask(entropy, old_entropy, low=band[0], high=band[1])
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


def erc_metrics(entropy: Tensor, old_entropy: Tensor, delta: float | None, loss_mask: Tensor,
                *, low: float | None = None, high: float | None = None) -> dict[str, Tensor]:
    """ERC diagnostics: fraction of masked tokens whose gradient ERC removes, mean entropy
    ratio."""
    keep = entropy_ratio_mask(entropy, old_entropy, delta, low=low, high=high)
    return {"erc_clipfrac": masked_mean((~keep).float(), loss_mask),
            "entropy_ratio_mean": masked_mean(entropy_ratio(entropy, old_entropy), loss_mask)}


def policy_loss(name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                loss_mask: Tensor, *, eps_low: float = 0.2, eps_high: float = 0.28,
                beta1: float = 1.0, beta2: float = 1.0, dual_clip: float | None = None,
                entropy: Tensor | None = None, old_entropy: Tensor | None = None,
                entropy_ratio_clip: float | None = None, erc_low: float | None = None,
                erc_high: float | None = None,
                normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level policy loss of ``name`` over the masked tokens, and its metrics."""
    per_token = per_token_policy_loss(name, logprobs, old_logprobs, advantages, eps_low=eps_low,
                                      eps_high=eps_high, beta1=beta1, beta2=beta2,
                                      dual_clip=dual_clip, entropy=entropy,
                                      old_entropy=old_entropy,
                                      entropy_ratio_clip=entropy_ratio_clip, erc_low=erc_low,
                                      erc_high=erc_high)
    metrics = policy_metrics(logprobs, old_logprobs, advantages, loss_mask, eps_low=eps_low,
                             eps_high=eps_high)
    if erc_band(entropy_ratio_clip, erc_low, erc_high) is not None:
        metrics.update(erc_metrics(entropy, old_entropy, entropy_ratio_clip, loss_mask,
                                   low=erc_low, high=erc_high))
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


# --------------------------------------------------------------------------- RL aggregation

LOSS_AGGREGATIONS = ("token-mean", "token-mean-micro", "seq-mean-token-sum", "seq-mean-token-mean")
VERL_EPS = 1e-8   # verl's masked_mean: sum / (count + 1e-8)


class AggregationTotals(NamedTuple):
    """Counts of the whole mini-batch (all micro-batches, all data-parallel ranks) that the
    aggregations divide by; ``dp_size`` undoes the gradient average over data-parallel ranks."""

    tokens: float              # response tokens
    positive_tokens: float     # response tokens of positive (max-score) responses
    sequences: float           # responses
    positive_sequences: float  # positive responses
    dp_size: int = 1


class MicroCounts(NamedTuple):
    """Counts of ONE whole micro-batch (before any context-parallel slicing), int64 tensors."""

    tokens: Tensor
    positive_tokens: Tensor
    sequences: Tensor


def verl_masked_mean(values: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """verl's ``masked_mean`` with its integer response mask: ``sum(values * mask) / (count +
    1e-8)``, where ``count`` (int64, default ``mask``'s sum) plus the Python 1e-8 is a float32
    (torch's promotion of an integer tensor and a float scalar), i.e. exactly the count for any
    count below 2^24. The official per-micro-batch token mean, operation for operation."""
    if count is None:
        count = mask.to(torch.int64).sum()
    return (values * mask.to(values.dtype)).sum() / (count.to(torch.int64) + VERL_EPS)


def aggregate_rl_loss(mode: str, policy: Tensor, nll: Tensor, loss_mask: Tensor,
                      positive: Tensor, sft_alpha: float, totals: AggregationTotals, *,
                      seq_tokens: Tensor | None = None, micro: MicroCounts | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """This micro-batch's share of the mini-batch loss ``policy + alpha * SFT``, as (total,
    policy term, SFT term); the shares summed over micro-batches and data-parallel ranks give
    the mini-batch loss (the engine's contract, train/engine.py ``forward_backward``).

    ``policy`` / ``nll`` are per-token losses (the NLL ``-logp``), ``positive`` flags the tokens
    of max-score responses, ``seq_tokens`` the response length of each token's sequence (the
    ``seq-mean-token-mean`` mode). The modes (docs/recipe.md):

    * ``token-mean``: the paper's token mean over the whole mini-batch (SFT: over its positive
      tokens);
    * ``token-mean-micro``: Klear's official actor: per micro-batch ``(alpha * SFT_mean +
      policy_mean) * (sequences in the micro-batch / per-rank mini-batch size)``, token means
      as verl's masked_mean (SFT over the micro-batch's positive responses), then the gradient
      average over data-parallel ranks, i.e. the share is that divided by ``dp_size``;
    * ``seq-mean-token-sum`` / ``seq-mean-token-mean``: each response's token sum / token mean,
      averaged over the mini-batch's responses (SFT: over its positive responses), which is
      what verl's per-micro-batch sequence means become under its dynamic-batch scaling.
    """
    mask = loss_mask.to(policy.dtype)
    pos_mask = mask * positive.to(policy.dtype)
    if mode == "token-mean":
        pg = aggregate(policy, mask, totals.tokens)
        sft = aggregate(nll, pos_mask, totals.positive_tokens)
        return pg + sft_alpha * sft, pg, sft
    if mode == "token-mean-micro":
        if micro is None:
            raise ValueError("token-mean-micro needs the micro-batch's counts (micro=)")
        per_rank = totals.sequences / totals.dp_size
        scale = float(micro.sequences) / per_rank / totals.dp_size
        pg = verl_masked_mean(policy, mask, micro.tokens)
        sft = verl_masked_mean(nll, pos_mask, micro.positive_tokens)
        return (sft_alpha * sft + pg) * scale, pg * scale, sft * scale
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        if mode == "seq-mean-token-mean":
            if seq_tokens is None:
                raise ValueError("seq-mean-token-mean needs seq_tokens (each token's response "
                                 "length)")
            per = seq_tokens.to(policy.dtype).clamp(min=1)
            policy, nll = policy / per, nll / per
        pg = aggregate(policy, mask, totals.sequences)
        sft = aggregate(nll, pos_mask, totals.positive_sequences)
        return pg + sft_alpha * sft, pg, sft
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGGREGATIONS}")
