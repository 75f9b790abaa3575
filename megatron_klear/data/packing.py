"""Sequence packing in THD layout: whole sequences end to end in one row, no s x s mask.

A pack is one micro-batch ``[1, T]``: sequence i contributes its ``len - 1`` next-token
positions, ``cu_seqlens`` marks where each sequence starts, and position ids restart at 0
for every sequence. The model reads ``cu_seqlens`` as megatron's ``PackedSeqParams``
(qkv_format ``thd``): Transformer Engine's THD attention on GPU,
:class:`~megatron_klear.models.varlen_attention.VarlenCoreAttention` in the local spec, so a
packed sequence sees exactly what it would see alone. SFT (bins) and RL (token-budget
micro-batches) both pack through :func:`pack_bins` and :func:`thd_pack`.
"""

from __future__ import annotations

from itertools import chain
from typing import Mapping, Sequence

import torch


def balance(sizes: Sequence[int], ranks: int) -> list[int]:
    """Owner rank of each item: largest first onto the least loaded rank (deterministic; ties:
    the earlier item, the lower rank). Spreads work evenly over ranks or threads: RL rows over
    data-parallel ranks by tokens, checkpoint records over writer threads by bytes."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def pack_bins(lengths: Sequence[int], bin_size: int, window: int | None = 256
              ) -> list[list[int]]:
    """Group sample indices into bins whose next-token positions (``len - 1``) fit ``bin_size``.

    First-fit decreasing (ties by index) inside consecutive windows of ``window`` samples
    (``None``: one window): bins are a deterministic function of the sample order, and no
    sample moves to another window. ``window=1`` puts every sample in its own bin.
    """
    bins: list[list[int]] = []
    window = window or max(len(lengths), 1)
    for start in range(0, len(lengths), window):
        members = range(start, min(start + window, len(lengths)))
        opened: list[tuple[list[int], list[int]]] = []  # ([used], indices)
        for i in sorted(members, key=lambda j: (-lengths[j], j)):
            need = lengths[i] - 1
            if need > bin_size:
                raise ValueError(f"sample {i} has {lengths[i]} tokens, more than the bin "
                                 f"({bin_size} + 1)")
            for used, idx in opened:
                if used[0] + need <= bin_size:
                    used[0] += need
                    idx.append(i)
                    break
            else:
                opened.append(([need], [i]))
        bins += [sorted(idx) for _, idx in opened]
    return bins


def thd_pack(seqs: Sequence[Sequence[int]],
             label_fields: Mapping[str, Sequence[Sequence[float]]] | None = None, *,
             pad_id: int = 0, multiple: int = 1) -> dict:
    """One THD micro-batch from whole token sequences.

    Returns tokens, labels, position_ids and segment_ids (-1 on padding) ``[1, T]`` (long),
    one float ``[1, T]`` tensor per entry of ``label_fields`` (per sequence, one value per
    label, i.e. ``len - 1`` values), ``cu_seqlens`` (int32 ``[n + 1]``) and ``max_seqlen``.
    With ``multiple > 1`` the pack is padded at its end to a multiple of it (e.g. the TP size
    for sequence parallelism); the padding is a segment of its own with zero label fields.
    """
    lens = [len(s) - 1 for s in seqs]
    if not seqs or min(lens) < 1:
        raise ValueError("a pack needs at least one sequence, each of >= 2 tokens")
    pad = -sum(lens) % multiple
    spans = lens + ([pad] if pad else [])
    out: dict = {
        "tokens": list(chain.from_iterable(s[:-1] for s in seqs)) + [pad_id] * pad,
        "labels": list(chain.from_iterable(s[1:] for s in seqs)) + [pad_id] * pad,
    }
    out = {k: torch.tensor(v, dtype=torch.long)[None] for k, v in out.items()}
    for name, per_seq in (label_fields or {}).items():
        for i, (vals, n) in enumerate(zip(per_seq, lens)):
            if len(vals) != n:
                raise ValueError(f"{name} of sequence {i} has {len(vals)} values for {n} labels")
        out[name] = torch.tensor(list(chain.from_iterable(per_seq)) + [0.0] * pad,
                                 dtype=torch.float)[None]
    sizes = torch.tensor(spans)
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32)
    cu[1:] = sizes.cumsum(0)
    starts = torch.repeat_interleave(cu[:-1].long(), sizes)
    out["position_ids"] = (torch.arange(int(cu[-1])) - starts)[None]
    seg = torch.repeat_interleave(torch.arange(len(spans)), sizes)
    out["segment_ids"] = torch.where(seg < len(seqs), seg, -1)[None]
    out["cu_seqlens"], out["max_seqlen"] = cu, max(spans)
    return out


def build_packed_batch(samples: Sequence[tuple[list[int], list[int]]]
                       | Mapping[int, tuple[list[int], list[int]]],
                       members: Sequence[int], *, pad_id: int = 0, multiple: int = 1) -> dict:
    """The THD pack of SFT samples ``members`` (indices into ``samples`` of (input_ids,
    loss_mask) pairs): :func:`thd_pack` with a ``loss_mask`` aligned with the labels."""
    chosen = [samples[i] for i in members]
    return thd_pack([ids for ids, _ in chosen], {"loss_mask": [m[1:] for _, m in chosen]},
                    pad_id=pad_id, multiple=multiple)


def padding_fraction(lengths: Sequence[int], seq_length: int, packed: bool) -> float:
    """Fraction of bin slots that hold padding, packed or one sample per bin."""
    bins = pack_bins(lengths, seq_length, window=256 if packed else 1)
    used = sum(n - 1 for n in lengths)
    return 1.0 - used / (len(bins) * seq_length)
