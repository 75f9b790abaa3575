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
             pad_id: int = 0, multiple: int = 1,
             prompt_lens: Sequence[int] | None = None) -> dict:
    """One THD micro-batch from whole token sequences.

    Returns tokens, labels, position_ids and segment_ids (each label's sequence, -1 on
    padding) ``[1, T]`` (long), one float ``[1, T]`` tensor per entry of ``label_fields``
    (per sequence, one value per label, i.e. ``len - 1`` values; an entry given as tensors
    ``[len - 1, ...]`` packs to ``[1, T, ...]`` of their dtype, its padding a copy of the
    last real row), ``cu_seqlens`` (int32, one
    span per segment) and ``max_seqlen``. With ``multiple > 1`` the pack is padded at its end
    to a multiple of it (e.g. the TP size for sequence parallelism); the padding is a
    segment of its own with zero label fields.

    ``prompt_lens`` (prompt sharing): consecutive sequences that start with the same prompt
    (``prompt_lens[i]`` tokens) carry it once: a prefix segment (the prompt but its last
    token; segment id -1, label fields of the run's first sequence), then one branch per
    sequence (the prompt's last token and the response), its positions continuing the
    prompt's. ``parent_segment`` (long, -1: none) tells the attention that a branch sees its
    prefix first (:class:`~megatron_klear.models.varlen_attention.VarlenCoreAttention`). Each
    response label keeps its own logits and fields; the prompt's labels are scored once, so
    share only prompts whose labels carry no loss (RL's loss mask).
    """
    if not seqs or min(len(s) for s in seqs) < 2:
        raise ValueError("a pack needs at least one sequence, each of >= 2 tokens")
    for name, per_seq in (label_fields or {}).items():
        for i, (vals, s) in enumerate(zip(per_seq, seqs)):
            if len(vals) != len(s) - 1:
                raise ValueError(f"{name} of sequence {i} has {len(vals)} values for "
                                 f"{len(s) - 1} labels")
    segs = _segments(seqs, prompt_lens)
    spans = [b - a for _, a, b, _, _ in segs]
    pad = -sum(spans) % multiple
    out: dict = {
        "tokens": [t for i, a, b, _, _ in segs for t in seqs[i][a:b]] + [pad_id] * pad,
        "labels": [t for i, a, b, _, _ in segs for t in seqs[i][a + 1:b + 1]] + [pad_id] * pad,
        "position_ids": [t for _, a, b, _, _ in segs for t in range(a, b)] + list(range(pad)),
        "segment_ids": [sid for _, a, b, _, sid in segs for _ in range(a, b)] + [-1] * pad,
    }
    out = {k: torch.tensor(v, dtype=torch.long)[None] for k, v in out.items()}
    for name, per_seq in (label_fields or {}).items():
        if torch.is_tensor(per_seq[0]):  # [labels, ...] per sequence, e.g. routed experts
            parts = [per_seq[i][a:b] for i, a, b, _, _ in segs]
            parts.append(parts[-1][-1:].expand(pad, *parts[-1].shape[1:]))  # a real row
            out[name] = torch.cat(parts)[None]
            continue
        vals = [v for i, a, b, _, _ in segs for v in per_seq[i][a:b]] + [0.0] * pad
        out[name] = torch.tensor(vals, dtype=torch.float)[None]
    spans += [pad] if pad else []
    cu = torch.zeros(len(spans) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(spans).cumsum(0)
    out["cu_seqlens"], out["max_seqlen"] = cu, max(spans)
    if any(parent >= 0 for _, _, _, parent, _ in segs):
        out["parent_segment"] = torch.tensor([s[3] for s in segs] + [-1] * bool(pad))
    return out


def run_positions(prompt_len: int, lengths: Sequence[int]) -> int:
    """Next-token positions that :func:`thd_pack` with ``prompt_lens`` gives a run of
    sequences (``lengths`` tokens each) that start with one prompt of ``prompt_len`` tokens:
    the prompt once when the run is shared, else every sequence whole."""
    if _shares(prompt_len, lengths):
        return prompt_len - 1 + sum(n - prompt_len for n in lengths)
    return sum(n - 1 for n in lengths)


def _shares(prompt_len: int, lengths: Sequence[int]) -> bool:
    """Whether a run of sequences after one prompt is packed as prefix + branches: two or
    more, each with a response, after a prompt of at least two tokens."""
    return prompt_len > 1 and len(lengths) > 1 and min(lengths) > prompt_len


def _segments(seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int] | None
              ) -> list[tuple[int, int, int, int, int]]:
    """The pack's segments: (sequence, first input token, end, parent segment, segment id).
    A segment's inputs are ``seq[a:b]``, its labels ``seq[a + 1:b + 1]``, its positions
    ``a..b-1``."""
    segs: list[tuple[int, int, int, int, int]] = []
    i = 0
    while i < len(seqs):
        p = prompt_lens[i] if prompt_lens is not None else 0
        j = i + 1  # the run of sequences after i that start with the same prompt
        while (1 < p and j < len(seqs) and prompt_lens[j] == p
               and list(seqs[j][:p]) == list(seqs[i][:p])):
            j += 1
        if _shares(p, [len(seqs[k]) for k in range(i, j)]):
            prefix = len(segs)
            segs.append((i, 0, p - 1, -1, -1))
            segs += [(k, p - 1, len(seqs[k]) - 1, prefix, k) for k in range(i, j)]
        else:
            segs += [(k, 0, len(seqs[k]) - 1, -1, k) for k in range(i, j)]
        i = j
    return segs


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
