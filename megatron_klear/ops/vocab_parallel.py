"""Fused vocab-parallel log-probs, entropy and policy loss (GPPO / PPO / CISPO).

Under tensor parallelism the logits are sharded over the vocabulary: rank r holds the global
columns ``[r * V/TP, (r + 1) * V/TP)`` (megatron's VocabUtility convention), target ids are
global. Slots at global index >= ``vocab_size`` are padding and count as -inf.

Backends (``backend=``):

* ``torch``: the specification. Gathers the full vocabulary (differentiably), upcasts to fp32 and
  uses ``log_softmax``; simple and obviously right, but keeps softmax-sized fp32 copies alive.
* ``cpu`` / ``cuda``: the fused kernels of the ``megatron_klear._C`` extension (csrc/). Per token
  they keep O(1) floats: a stats pass (max, sum-exp, entropy accumulator, target logit), ONE
  all-gather of the ``[T, 4]`` stats across the TP group, and a backward that recomputes the
  softmax from the logits (optionally writing the gradient in place into the logits buffer).
* ``auto``: the fused kernel for the logits' device when the extension has it, else ``torch``.

Gradient convention (as megatron's vocab_parallel_cross_entropy): every TP rank computes the same
loss; the gradient returned for a rank's shard is the gradient of that one loss w.r.t. the shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_klear.ops.loss_math import (ERC_MAX_LOG_RATIO, SEQUENCE_LOSSES, PolicyLossSpec,
                                          aggregate, erc_metrics, per_token_policy_loss,
                                          policy_metrics)

__all__ = ["PolicyLossOutput", "vocab_parallel_policy_loss", "vocab_parallel_logprobs",
           "vocab_parallel_gather_logits", "available_backends", "resolve_backend"]

_KERNEL_LOSS_TYPES = {"ppo": 0, "gppo": 1, "cispo": 2}


class PolicyLossOutput(NamedTuple):
    """Result of :func:`vocab_parallel_policy_loss` (per-token tensors shaped like the targets)."""

    loss: Tensor              # scalar (per token with reduction="none"), differentiable
    logprobs: Tensor          # differentiable w.r.t. the logits shard
    ratio: Tensor             # exp(logprobs - old_logprobs), detached
    entropy: Tensor | None    # of the temperature-scaled distribution (when compute_entropy)
    metrics: dict[str, Tensor]


# --------------------------------------------------------------------------- backends

def _extension_ops():
    """torch.ops.klear when the C++ extension is built, else None. Rejects an environment
    variable KLEAR_CPU_ISA (caps the CPU kernel copy, see csrc/cpu/) that names no copy."""
    try:
        from megatron_klear import _C  # noqa: F401  (registers torch.ops.klear)
    except ImportError:
        return None
    cap = os.environ.get("KLEAR_CPU_ISA")
    if cap is not None and cap not in _C.cpu_isa_names:
        raise ValueError(f"KLEAR_CPU_ISA={cap!r} names no CPU kernel copy: use one of "
                         f"{', '.join(_C.cpu_isa_names)} or unset it")
    return torch.ops.klear


def _extension_has_cuda() -> bool:
    if _extension_ops() is None:
        return False
    from megatron_klear import _C
    return bool(getattr(_C, "with_cuda", False))


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends usable for tensors on ``device``, fastest first (``torch`` always last)."""
    kind = torch.device(device).type
    fused = {"cpu": _extension_ops() is not None, "cuda": _extension_has_cuda()}
    return [b for b in ("cuda", "cpu") if b == kind and fused[b]] + ["torch"]


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn ``auto`` into a concrete backend and check that a requested one can run here."""
    if backend == "auto":
        return available_backends(device)[0]
    if backend not in ("torch", "cpu", "cuda"):
        raise ValueError(f"backend must be one of auto, torch, cpu, cuda (got {backend!r})")
    kind = torch.device(device).type
    if backend != "torch" and backend != kind:
        raise ValueError(f"backend={backend!r} cannot run on {kind} tensors; use backend='auto'")
    if backend not in available_backends(device):
        raise RuntimeError(
            f"backend={backend!r} needs the compiled extension megatron_klear._C"
            f"{' with CUDA' if backend == 'cuda' else ''}; build it with "
            "`python setup.py build_ext --inplace` (or `pip install --no-build-isolation -e .`),"
            " or pass backend='torch'")
    return backend


# --------------------------------------------------------------------------- vocab shards

@dataclass(frozen=True)
class _Shard:
    """Where this rank's logits columns sit in the global (padded) vocabulary."""

    group: object | None
    rank: int
    size: int
    local: int        # columns of this shard (V/TP, padding included)
    start: int        # global index of column 0
    vocab_size: int   # true global vocabulary (unpadded)

    @property
    def valid(self) -> int:
        """How many leading columns of this shard are real (not padding)."""
        return max(0, min(self.local, self.vocab_size - self.start))


def _shard(logits: Tensor, tp_group, vocab_size: int | None) -> _Shard:
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if size > 1 else 0
    local = logits.shape[-1]
    padded = local * size
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (V/TP={local} x TP="
                         f"{size}); pass the tokenizer's true vocabulary size")
    return _Shard(tp_group if size > 1 else None, rank, size, local, rank * local, vocab_size)


def _check_targets(target_ids: Tensor, shard: _Shard, rows: int) -> Tensor:
    """Flat int64 targets; the range check is an asynchronous device assert (no host sync)."""
    targets = target_ids.reshape(-1).long()
    if targets.numel() != rows:
        raise ValueError(f"target_ids has {targets.numel()} elements but logits have {rows} rows;"
                         " target_ids must have the logits' leading shape")
    if targets.numel():
        torch._assert_async(((targets >= 0) & (targets < shard.vocab_size)).all(),
                            f"target_ids must be global token ids in [0, {shard.vocab_size}) "
                            "(replace ignore-index targets by any valid id and mask them with "
                            "loss_mask)")
    return targets


class _SumShards(torch.autograd.Function):
    """All-reduce (sum) of per-shard partial values; backward hands each rank the gradient as
    it is (the loss is replicated on every TP rank, each rank differentiates its own shard)."""

    @staticmethod
    def forward(ctx, part: Tensor, group) -> Tensor:
        out = part.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


# --------------------------------------------------------------------------- torch reference

class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary shards; backward hands each rank its own slice (replicated loss)."""

    @staticmethod
    def forward(ctx, shard: Tensor, group, rank: int, size: int) -> Tensor:
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.rank, ctx.local = rank, shard.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        begin = ctx.rank * ctx.local
        return grad[..., begin:begin + ctx.local], None, None, None


def _reference_logprobs(logits: Tensor, targets: Tensor, shard: _Shard, temperature: float,
                        compute_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(logp, entropy or None) [T] from a full-vocabulary fp32 log_softmax (the specification)."""
    x = logits.float()
    if shard.group is not None:
        x = _GatherVocab.apply(x, shard.group, shard.rank, shard.size)
    if temperature != 1.0:
        x = x / temperature
    padding = torch.arange(x.shape[-1], device=x.device) >= shard.vocab_size
    if padding.any():
        x = x.masked_fill(padding, float("-inf"))
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not compute_entropy:
        return logp, None
    finite = torch.where(torch.isinf(logp_all), 0.0, logp_all)   # p log p = 0 where p = 0
    return logp, -(logp_all.exp() * finite).sum(-1)


# --------------------------------------------------------------------------- fused kernels

def _merge_stats(stats: Tensor, group, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """All-gather [T, 4] shard stats {m, d, s, x_target} and merge them into (lse, logp, H)."""
    if group is not None:
        parts = [torch.empty_like(stats) for _ in range(size)]
        dist.all_gather(parts, stats, group=group)
        return merge_shard_stats(torch.stack(parts))
    return merge_shard_stats(stats[None])


def merge_shard_stats(stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, logp, H) [T] from the stats [TP, T, 4] of every shard, merged in rank order."""
    m, d, s, target = stats.unbind(-1)
    big_m = m.max(dim=0).values
    has = d > 0                              # shards with no real columns contribute nothing
    w = torch.where(has, torch.exp(m - big_m), 0.0)
    total_d = (w * d).sum(0)
    total_s = torch.where(has, w * (s + d * (m - big_m)), 0.0).sum(0)
    lse = big_m + torch.log(total_d)
    entropy = torch.log(total_d) - total_s / total_d
    return lse, target.sum(0) - lse, entropy


class _FusedLogProbs(torch.autograd.Function):
    """logits shard [T, V/TP] -> (logp [T], entropy [T]) with the extension's kernels."""

    @staticmethod
    def forward(ctx, logits: Tensor, target_local: Tensor, shard: _Shard, inv_temp: float,
                inplace: bool) -> tuple[Tensor, Tensor]:
        ops = _extension_ops()
        stats = ops.logprob_stats(logits, target_local, shard.valid, inv_temp)
        lse, logp, entropy = _merge_stats(stats, shard.group, shard.size)
        ctx.save_for_backward(logits, target_local, lse, entropy)
        ctx.valid, ctx.inv_temp, ctx.inplace = shard.valid, inv_temp, inplace
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, target_local, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_ent = None if grad_entropy is None else grad_entropy.float().contiguous()
        ops = _extension_ops()
        backward = ops.logprob_backward_ if ctx.inplace else ops.logprob_backward
        grad = backward(logits, target_local, lse, entropy, grad_logp.float().contiguous(),
                        grad_ent, ctx.valid, ctx.inv_temp)
        return grad, None, None, None, None


class _FusedTokenLoss(torch.autograd.Function):
    """Per-token policy loss kernel: (logp, old, adv[, entropies]) -> (loss [T], ratio [T]).

    ``entropies`` = (current, old) per-token entropies (detached) when ERC is on, else None.
    """

    @staticmethod
    def forward(ctx, logp: Tensor, old: Tensor, adv: Tensor, entropies: tuple | None,
                loss_type: str, hyper: tuple) -> tuple[Tensor, Tensor]:
        ent, old_ent = (None, None) if entropies is None else \
            (e.detach().float().contiguous() for e in entropies)
        loss, dlogp, ratio = _extension_ops().token_policy_loss(
            logp.contiguous(), old.contiguous(), adv.contiguous(), ent, old_ent,
            _KERNEL_LOSS_TYPES[loss_type], *hyper)
        ctx.save_for_backward(dlogp)
        ctx.mark_non_differentiable(ratio)
        return loss, ratio

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ratio):
        (dlogp,) = ctx.saved_tensors
        return grad_loss * dlogp, None, None, None, None, None


# --------------------------------------------------------------------------- public API

def _logprobs(logits: Tensor, target_ids: Tensor, *, tp_group, vocab_size: int | None,
              temperature: float, backend: str, compute_entropy: bool, inplace: bool = False
              ) -> tuple[Tensor, Tensor | None, str]:
    """Flat (logp [T], entropy [T] or None) of the targets and the backend that computed them."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    rows = logits.reshape(-1, logits.shape[-1])
    shard = _shard(logits, tp_group, vocab_size)
    targets = _check_targets(target_ids, shard, rows.shape[0])
    backend = resolve_backend(backend, logits.device)
    if inplace and backend != "torch" and not logits.is_contiguous():
        raise ValueError(f"inplace_backward=True needs contiguous logits (got shape "
                         f"{tuple(logits.shape)}, strides {logits.stride()}): the gradient would "
                         "go into a copy; pass logits.contiguous() or inplace_backward=False")
    if backend == "torch":
        return (*_reference_logprobs(rows, targets, shard, temperature, compute_entropy), backend)
    target_local = (targets - shard.start).contiguous()
    logp, entropy = _FusedLogProbs.apply(rows.contiguous(), target_local, shard,
                                         1.0 / temperature, inplace)
    return logp, entropy if compute_entropy else None, backend


def _per_token(name: str, values: Tensor, lead: torch.Size) -> Tensor:
    """``values`` flattened to [T] after checking it is shaped like the targets."""
    if values.shape != lead:
        raise ValueError(f"{name} must be shaped like the targets {tuple(lead)}; got "
                         f"{tuple(values.shape)}")
    return values.reshape(-1)


def _per_token_advantages(advantages: Tensor, lead: torch.Size) -> Tensor:
    """Advantages per token [T]: given per token (lead shape) or per sequence ([B] for [B, S])."""
    if advantages.shape == lead:
        return advantages.reshape(-1).float()
    if len(lead) == 2 and advantages.shape == lead[:1]:
        return advantages.float()[:, None].expand(lead).reshape(-1)
    raise ValueError(f"advantages must be shaped like the targets {tuple(lead)} (per token) or "
                     f"[{lead[0]}] (per sequence); got {tuple(advantages.shape)}")


def vocab_parallel_policy_loss(
        logits: Tensor, target_ids: Tensor, old_logprobs: Tensor, advantages: Tensor,
        loss_mask: Tensor, spec: PolicyLossSpec = PolicyLossSpec(), *,
        old_entropy: Tensor | None = None, sequence_ids: Tensor | None = None,
        temperature: float = 1.0, normalizer: float | Tensor | None = None,
        compute_entropy: bool = False, reduction: str = "mean", tp_group=None,
        backend: str = "auto", vocab_size: int | None = None, inplace_backward: bool = False,
) -> PolicyLossOutput:
    """Token-level policy loss straight from vocab-sharded logits [T, V/TP] or [B, S, V/TP].

    ``spec``: the loss and its hyper-parameters (:class:`~megatron_klear.ops.loss_math.
    PolicyLossSpec`, default GPPO 0.2/0.28). ``loss`` and ``logprobs`` are differentiable
    w.r.t. the logits shard (add e.g. ``alpha * sft_loss(out.logprobs, positive_mask)`` to the
    loss). ``inplace_backward=True`` lets the fused backends write the gradient into the logits
    buffer (the logits must not be needed after backward). ERC (the spec's band) needs
    ``old_entropy``, the behaviour policy's per-token entropy at the same temperature; GSPO
    needs ``sequence_ids``. ``reduction="none"`` returns the per-token losses (shaped like the
    targets, unmasked) for the caller to aggregate
    (:func:`~megatron_klear.ops.loss_math.aggregate_rl_loss`).
    See :func:`megatron_klear.ops.loss_math.policy_loss` for the losses.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none' (got {reduction!r})")
    band = spec.band
    erc = band is not None
    if erc and old_entropy is None:
        raise ValueError("entropy_ratio_clip needs old_entropy (the behaviour policy's "
                         "per-token entropy, e.g. from vocab_parallel_logprobs(..., "
                         "compute_entropy=True))")
    lead = logits.shape[:-1]
    logp, entropy, used = _logprobs(logits, target_ids, tp_group=tp_group, vocab_size=vocab_size,
                                    temperature=temperature, backend=backend,
                                    compute_entropy=compute_entropy or erc,
                                    inplace=inplace_backward)
    old = _per_token("old_logprobs", old_logprobs, lead).float()
    adv = _per_token_advantages(advantages, lead)
    mask = _per_token("loss_mask", loss_mask, lead)
    old_ent = _per_token("old_entropy", old_entropy, lead).float() if erc else None
    ent = entropy.detach() if erc else None
    loss_type = spec.loss_type
    if used != "torch" and loss_type in _KERNEL_LOSS_TYPES:
        hyper = (spec.eps_low, spec.eps_high, spec.beta1, spec.beta2,
                 -1.0 if spec.dual_clip is None else spec.dual_clip,
                 *(band if erc else (0.0, -1.0)))
        per_token, ratio = _FusedTokenLoss.apply(logp, old, adv, (ent, old_ent) if erc else None,
                                                 loss_type, hyper)
    else:
        per_seq = {}
        if loss_type in SEQUENCE_LOSSES:  # GSPO: per-token torch arithmetic on [T]
            if sequence_ids is None:
                raise ValueError(f"loss_type={loss_type!r} needs sequence_ids (each token's "
                                 "sequence, shaped like the targets)")
            per_seq = {"sequence_ids": _per_token("sequence_ids", sequence_ids, lead),
                       "loss_mask": mask}
        per_token = per_token_policy_loss(loss_type, logp, old, adv, eps_low=spec.eps_low,
                                          eps_high=spec.eps_high, beta1=spec.beta1,
                                          beta2=spec.beta2, dual_clip=spec.dual_clip,
                                          entropy=ent, old_entropy=old_ent,
                                          entropy_ratio_clip=spec.entropy_ratio_clip,
                                          erc_low=spec.erc_low, erc_high=spec.erc_high,
                                          **per_seq)
        log_ratio = logp - old
        if erc:   # the clamp of ERC's code (ops/loss_math.py ERC_MAX_LOG_RATIO)
            log_ratio = log_ratio.clamp(-ERC_MAX_LOG_RATIO, ERC_MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio).detach()
    metrics = policy_metrics(logp, old, adv, mask, eps_low=spec.eps_low, eps_high=spec.eps_high)
    if erc:
        metrics.update(erc_metrics(ent, old_ent, None, mask, low=band[0], high=band[1]))
    entropy = entropy if compute_entropy else None
    loss = per_token.view(lead) if reduction == "none" else aggregate(per_token, mask, normalizer)
    return PolicyLossOutput(loss, logp.view(lead),
                            ratio.view(lead), None if entropy is None else entropy.view(lead),
                            metrics)


def vocab_parallel_logprobs(logits: Tensor, target_ids: Tensor, tp_group=None,
                            compute_entropy: bool = False, *, temperature: float = 1.0,
                            vocab_size: int | None = None, backend: str = "auto",
                            with_grad: bool = False, inplace_backward: bool = False
                            ) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of the targets: old-logprob and eval passes (no gradient), or
    with ``with_grad=True`` the differentiable log-probs of the SFT loss, where
    ``inplace_backward=True`` lets the fused backends write the gradient into the logits
    buffer (the logits must not be read after backward)."""
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        logp, entropy, _ = _logprobs(logits, target_ids, tp_group=tp_group,
                                     vocab_size=vocab_size, temperature=temperature,
                                     backend=backend, compute_entropy=compute_entropy,
                                     inplace=inplace_backward)
    lead = logits.shape[:-1]
    return logp.view(lead), None if entropy is None else entropy.view(lead)


def vocab_parallel_gather_logits(logits: Tensor, ids: Tensor, tp_group=None,
                                 vocab_size: int | None = None) -> Tensor:
    """The fp32 logits of global token ``ids`` [..., k] (the logits' leading shape, k ids per
    position) from vocab-sharded ``logits`` [..., V/TP], differentiably: each rank picks the
    ids its shard holds, zero for the others, and one all-reduce of the [..., k] picks sums
    them; no full-vocabulary copy. On-policy distillation's top-k KL reads the student's
    logits of the teacher's top-k ids with it (algo/opd.py)."""
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} must have the logits' leading shape "
                         f"{tuple(logits.shape[:-1])} and k ids per position")
    shard = _shard(logits, tp_group, vocab_size)
    local = ids.long() - shard.start
    own = (local >= 0) & (local < shard.valid)
    picked = torch.where(own, logits.gather(-1, local.clamp(0, shard.local - 1)).float(), 0.0)
    return picked if shard.group is None else _SumShards.apply(picked, shard.group)
