"""Core attention for packed (THD) sequences in the local (non-Transformer-Engine) spec.

megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params``; the only way it
could serve a pack is a dense ``[b, 1, s, s]`` block-diagonal mask, whose size (and score
matrix) grows with the square of the whole pack. :class:`VarlenCoreAttention` has the same
constructor and ``forward`` as ``DotProductAttention``; for a ``thd`` pack it attends causally
within each sequence of ``cu_seqlens`` only. Sequences of similar length are gathered into
small right-padded groups (one causal scaled-dot-product call per group, no mask), so memory
is linear in the pack length apart from each sequence's own ``len x len`` scores, never ``T x T``.

Without ``packed_seq_params`` it is megatron's ``DotProductAttention`` unchanged. On GPU the
Transformer Engine spec serves packs with TE's own THD attention instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
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


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *,
                            scale: float, dropout_p: float = 0.0) -> Tensor:
    """Causal attention inside each sequence of a pack.

    ``query`` [T, heads, d], ``key``/``value`` [T, groups, d] (grouped-query attention when
    groups < heads), ``cu_seqlens`` [n + 1] covering all T tokens. Returns [T, heads, d].
    """
    total = query.shape[0]
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the pack length {total}; got "
                         f"{bounds[0]}..{bounds[-1]}")
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]
    gqa = query.shape[1] != key.shape[1]
    outs, where = [], []
    for members in length_groups(lengths, query.shape[1]):
        top = lengths[members[0]]
        lens = torch.tensor([lengths[i] for i in members])
        first = torch.tensor([starts[i] for i in members])
        steps = torch.arange(top)
        valid = steps[None, :] < lens[:, None]                       # [g, L]
        idx = torch.where(valid, first[:, None] + steps[None, :], first[:, None])
        q, k, v = (x[idx].transpose(1, 2) for x in (query, key, value))  # [g, heads, L, d]
        # the causal kernel, no mask: a member's padding follows its last token, so a real
        # query (before it) never sees a padding key; padding queries are dropped below, and
        # with zero probability and zero output gradient they pass no gradient either
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                           scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2)[valid])                        # [tokens, heads, d]
        where.append(idx[valid])
    order = torch.empty(total, dtype=torch.long)
    order[torch.cat(where)] = torch.arange(total)
    return torch.cat(outs)[order]


class VarlenCoreAttention(DotProductAttention):
    """megatron's DotProductAttention plus THD packs (attention within each sequence)."""

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
        p = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          scale=self.softmax_scale, dropout_p=p)
        return out.reshape(out.shape[0], -1)
