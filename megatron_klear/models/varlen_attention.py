"""Core attention for packed (THD) sequences in the local (non-Transformer-Engine) spec.

megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params``; the only way it
could serve a pack is a dense ``[b, 1, s, s]`` block-diagonal mask, whose size (and score
matrix) grows with the square of the whole pack. :class:`VarlenCoreAttention` has the same
constructor and ``forward`` as ``DotProductAttention``; for a ``thd`` pack it attends causally
within each sequence of ``cu_seqlens`` only. Sequences of similar length are gathered into
small right-padded groups (one causal scaled-dot-product call per group, no mask), so memory
is linear in the pack length apart from each sequence's own ``len x len`` scores, never ``T x T``.

Prompt sharing (RL, ``--share-prompts``): the n samples of a prompt carry it once, as a
prefix segment plus one branch segment per sample (:func:`~megatron_klear.data.packing.thd_pack`
with ``prompt_lens``). A branch attends to its prefix, then causally to itself, and its RoPE
positions continue the prefix's; this is a tree mask, which TE's THD attention cannot express,
so prompt sharing is a local-spec feature. With plain RoPE the module also rotates a pack's
queries and keys itself, per token (:class:`PackRotaryEmbedding`).

Without ``packed_seq_params`` it is megatron's ``DotProductAttention`` unchanged. On GPU the
Transformer Engine spec serves packs with TE's own THD attention instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

# padded length of a group may exceed its shortest member by this factor
GROUP_SLACK = 1.25
# at most this many score elements (groups x heads x len x len) per scaled-dot-product call
MAX_GROUP_SCORES = 2**24


def length_groups(lengths: list[int], num_heads: int, slack: float = GROUP_SLACK,
                  max_scores: int | None = None) -> list[list[int]]:
    """Sequence indices grouped by similar length (longest first), deterministic.

    A group's members are at least ``longest / slack`` long and its padded scores
    (members x heads x longest^2) stay under ``max_scores`` (default MAX_GROUP_SCORES),
    except a lone sequence.
    """
    max_scores = MAX_GROUP_SCORES if max_scores is None else max_scores
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if groups:
            top = lengths[groups[-1][0]]
            fits = (len(groups[-1]) + 1) * num_heads * top * top <= max_scores
            if fits and top <= slack * lengths[i]:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


@dataclass(frozen=True)
class _Group:
    """One scaled-dot-product call: ``size`` right-padded members of ``q_len`` query and
    ``k_len`` key slots, and the tree mask where a member sees a context segment
    ([g, Lq, Lk]; None: plain causal)."""

    size: int
    q_len: int
    k_len: int
    mask: Tensor | None


@dataclass(frozen=True)
class VarlenPlan:
    """Index tensors of a pack's attention, on the q/k/v device: made once per micro-batch
    from ``cu_seqlens`` (one host read) and reused by every layer, so the layers themselves
    neither read device values on the host nor send small tensors to the device.

    Every group's slots are gathered by one index per tensor (``q_index``, ``k_index``: the
    groups' padded slots back to back) and the tokens' outputs picked by one (``out_index``),
    so a layer's backward scatters each of q, k, v and the output once, not once per group."""

    total: int
    groups: tuple[_Group, ...]
    q_index: Tensor    # [sum g * Lq] the token of each query slot (padding: a member's first)
    k_index: Tensor    # [sum g * Lk] the token of each key slot
    out_index: Tensor  # [total] the query slot holding token i


def varlen_plan(cu_seqlens: Tensor | list[int], num_heads: int, device: torch.device,
                parents: list[int] | None = None) -> VarlenPlan:
    """The :class:`VarlenPlan` of a pack (``cu_seqlens`` [n + 1], ``parents`` as in
    :func:`varlen_causal_attention`) with every tensor on ``device``."""
    bounds = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {bounds[0]}")
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]
    parents = parents or [-1] * len(lengths)
    context = [lengths[p] if p >= 0 else 0 for p in parents]
    groups, q_slots, k_slots, valid = [], [], [], []
    plain, branches = ([i for i, c in enumerate(context) if bool(c) == b] for b in (False, True))
    for kind in (plain, branches):
        spans = [lengths[i] + context[i] for i in kind]
        for group in length_groups(spans, num_heads):
            members = [kind[g] for g in group]
            group, q_idx, k_idx, real = _group_indices(
                [starts[i] for i in members], [lengths[i] for i in members],
                [starts[parents[i]] for i in members], [context[i] for i in members])
            groups.append(group)
            q_slots.append(q_idx.flatten())
            k_slots.append(k_idx.flatten())
            valid.append(real.flatten())
    q_index, real = torch.cat(q_slots), torch.cat(valid)
    total = bounds[-1]
    out_index = torch.empty(total, dtype=torch.long)
    out_index[q_index[real]] = torch.arange(len(q_index))[real]
    return VarlenPlan(total, tuple(g if g.mask is None else
                                   _Group(g.size, g.q_len, g.k_len, g.mask.to(device))
                                   for g in groups),
                      q_index.to(device), torch.cat(k_slots).to(device), out_index.to(device))


def _group_indices(first: list[int], lengths: list[int], context_first: list[int],
                   context: list[int]) -> tuple[_Group, Tensor, Tensor, Tensor]:
    """A group and its members' query and key slots ([g, Lq], [g, Lk]) and which query slots
    are real ([g, Lq]): member m's keys are its context (``context[m]`` tokens from
    ``context_first[m]``), then its own tokens; its padding repeats its first token."""
    lens, ctx, first_t, ctx_first = map(torch.tensor, (lengths, context, first, context_first))
    steps = torch.arange(max(lengths))
    valid = steps[None, :] < lens[:, None]                                   # [g, Lq]
    q_idx = torch.where(valid, first_t[:, None] + steps[None, :], first_t[:, None])
    k_steps = torch.arange(max(a + b for a, b in zip(lengths, context)))[None, :]
    own = first_t[:, None] + k_steps - ctx[:, None]
    k_idx = torch.where(k_steps < ctx[:, None], ctx_first[:, None] + k_steps, own)
    k_idx = torch.where(k_steps < (ctx + lens)[:, None], k_idx, first_t[:, None])
    # query t of member m sees its context and its own tokens up to t
    mask = k_steps[:, None, :] <= ctx[:, None, None] + steps[None, :, None] if any(context) \
        else None
    return _Group(len(lengths), q_idx.shape[1], k_idx.shape[1], mask), q_idx, k_idx, valid


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *,
                            scale: float, dropout_p: float = 0.0,
                            parents: list[int] | None = None,
                            plan: VarlenPlan | None = None) -> Tensor:
    """Causal attention inside each sequence of a pack.

    ``query`` [T, heads, d], ``key``/``value`` [T, groups, d] (grouped-query attention when
    groups < heads), ``cu_seqlens`` [n + 1] covering all T tokens. ``parents`` (prompt
    sharing, see :func:`~megatron_klear.data.packing.thd_pack`): segment i attends to all of
    segment ``parents[i]`` before its own tokens (-1: none). ``plan``: the pack's
    :func:`varlen_plan`, made here when not given. Returns [T, heads, d].
    """
    total = query.shape[0]
    plan = plan or varlen_plan(cu_seqlens, query.shape[1], query.device, parents)
    if plan.total != total:
        raise ValueError(f"cu_seqlens must run from 0 to the pack length {total}; got "
                         f"0..{plan.total}")
    gqa = query.shape[1] != key.shape[1]
    # a token's only query slot with a gradient is its real one: padding slots pass none
    qs = _Rows.apply(query, plan.q_index, plan.out_index).split(
        [g.size * g.q_len for g in plan.groups])
    ks, vs = (_Rows.apply(x, plan.k_index, None).split(
        [g.size * g.k_len for g in plan.groups]) for x in (key, value))
    outs = []
    for g, q, k, v in zip(plan.groups, qs, ks, vs):
        q = q.view(g.size, g.q_len, *q.shape[1:]).transpose(1, 2)           # [g, heads, Lq, d]
        k, v = (x.view(g.size, g.k_len, *x.shape[1:]).transpose(1, 2) for x in (k, v))
        # no mask: the causal kernel; a member's padding follows its last token, so a real
        # query (before it) never sees a padding key; padding queries are dropped below, and
        # with zero probability and zero output gradient they pass no gradient either
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if g.mask is None else g.mask[:, None],
            dropout_p=dropout_p, is_causal=g.mask is None, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).flatten(0, 1))
    return _Rows.apply(torch.cat(outs), plan.out_index, None)


class _Rows(torch.autograd.Function):
    """``x[index]`` along dim 0, whose backward adds the rows' gradients with ``index_add_``
    (autograd's indexing backward accumulates element by element, several times slower on
    CPU); with ``owner`` (x's row i takes its gradient from row ``owner[i]`` alone: every
    other copy's gradient is zero), it picks them with no accumulation at all."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, owner: Tensor | None) -> Tensor:  # noqa: D102
        ctx.save_for_backward(index, owner)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        index, owner = ctx.saved_tensors
        if owner is not None:
            return grad.index_select(0, owner), None, None
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_add_(0, index, grad), None, None


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """A THD pack with prompt sharing: ``parent_segment[i]`` is the segment that segment i
    sees before its own tokens, and whose positions it continues (-1: none)."""

    parent_segment: Tensor | None = None


def pack_positions(cu_seqlens: list[int], parents: list[int] | None = None) -> Tensor:
    """Each token's RoPE position in a pack [T]: its offset in its segment, plus the length of
    the segment it continues (``parents`` as in :class:`SharedPrefixParams`; None: none)."""
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    shift = [lengths[p] if p >= 0 else 0 for p in parents] if parents else [0] * len(lengths)
    offsets = torch.tensor([s - start for s, start in zip(shift, cu_seqlens)])
    return torch.arange(cu_seqlens[-1]) + torch.repeat_interleave(offsets, torch.tensor(lengths))


class PackRotaryEmbedding(RotaryEmbedding):
    """megatron's plain RotaryEmbedding, except that it gives no angles for a THD pack, so that
    megatron's attention leaves the pack unrotated and :class:`VarlenCoreAttention` rotates
    it: in one pass per tensor, at positions made once per micro-batch. megatron's own THD
    RoPE loops over the pack's sequences, and a shared prompt's branches then needed a second
    rotation to continue their prompt's positions. (models.qwen3.build_gpt_model sets it
    with the local spec and plain RoPE.)"""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Tensor | None:  # noqa: D102
        if packed_seq:
            return None
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


def _cached_plan(params: PackedSeqParams, num_heads: int, device: torch.device) -> VarlenPlan:
    """The pack's :class:`VarlenPlan`, made by the first layer and kept on ``params`` (one
    object per micro-batch, shared by every layer of the forward and of a recompute)."""
    plan = getattr(params, "klear_varlen_plan", None)
    if plan is None or plan.out_index.device != device:
        parents = getattr(params, "parent_segment", None)
        plan = varlen_plan(params.cu_seqlens_q, num_heads, device,
                           None if parents is None else parents.tolist())
        params.klear_varlen_plan = plan
    return plan


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """RoPE's rotation of the pairs of ``x`` (megatron's rope_utils ``_rotate_half``): the
    halves (-x2, x1), or with ``interleaved`` the even/odd elements."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VarlenCoreAttention(DotProductAttention):
    """megatron's DotProductAttention plus THD packs (attention within each sequence, RoPE per
    token) and prompt sharing (:class:`SharedPrefixParams`)."""

    # the model's RoPE table, ``get_emb(n)`` -> [n, 1, 1, d], set by models.qwen3.build_gpt_model
    # with plain RoPE, where the model's PackRotaryEmbedding leaves packs to this module
    position_emb: Callable[[int], Tensor] | None = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        """[s, b, h*d] as DotProductAttention; for a ``thd`` pack [T, h, d] in, [T, h*d] out."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, None)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise ValueError("VarlenCoreAttention serves qkv_format 'thd' packs without "
                             f"attention_bias (got {packed_seq_params.qkv_format!r})")
        if self.position_emb is not None:
            query, key = self._rotate(query, key, packed_seq_params)
        elif getattr(packed_seq_params, "parent_segment", None) is not None:
            raise ValueError("prompt sharing needs the model's plain RoPE table on the core "
                             "attention (models.qwen3.build_gpt_model sets it; rope scaling "
                             "such as yarn is not supported): drop --share-prompts")
        plan = _cached_plan(packed_seq_params, query.shape[1], query.device)
        p = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          scale=self.softmax_scale, dropout_p=p, plan=plan)
        return out.reshape(out.shape[0], -1)

    def _rotate(self, query: Tensor, key: Tensor, params: PackedSeqParams
                ) -> tuple[Tensor, Tensor]:
        """Queries and keys rotated at :func:`pack_positions`, as megatron's unfused
        ``apply_rotary_pos_emb`` rotates (full head width, mscale 1: the same ops, the same
        bits), except that the cosines and sines of the angles are made once per pack, by the
        first layer, and kept on ``params`` ([T, 1, d] each), not once per layer and tensor."""
        rotation = getattr(params, "klear_rotation", None)
        if rotation is None:
            parents = getattr(params, "parent_segment", None)
            positions = pack_positions(params.cu_seqlens_q.tolist(),
                                       None if parents is None else parents.tolist())
            table = self.position_emb(int(positions.max()) + 1)
            angles = table[positions.to(table.device)].squeeze(1)
            rotation = params.klear_rotation = tuple(
                f(angles).to(query.dtype) for f in (torch.cos, torch.sin))
        cos, sin = rotation
        interleaved = self.config.rotary_interleaved

        def rotate(t: Tensor) -> Tensor:
            return t * cos + _rotate_half(t, interleaved) * sin

        return rotate(query), rotate(key)
