"""Sequence packing: several samples per fixed-length bin, with no attention across them.

A bin holds whole samples in order. Each sample contributes ``len - 1`` next-token
positions; position ids restart at 0 for every sample, and the attention mask is
block-diagonal causal, so a packed sample sees exactly what it would see alone.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def pack_bins(lengths: Sequence[int], bin_size: int, window: int = 256) -> list[list[int]]:
    """Group sample indices into bins whose next-token positions fit ``bin_size``.

    First-fit decreasing inside consecutive windows of ``window`` samples: bins are a
    deterministic function of the sample order (so the data position of a run is the
    number of bins consumed), and no sample moves to another window. ``window=1`` puts
    every sample in its own bin.
    """
    bins: list[list[int]] = []
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


def build_packed_batch(samples: Sequence[tuple[list[int], list[int]]]
                       | Mapping[int, tuple[list[int], list[int]]],
                       bins: Sequence[Sequence[int]], seq_length: int, pad_id: int = 0
                       ) -> dict[str, torch.Tensor]:
    """A micro-batch [len(bins), seq_length] from (input_ids, loss_mask) samples, indexed
    by the sample ids in ``bins``.

    Returns tokens, labels, loss_mask, position_ids, segment_ids (-1 on padding) and a
    boolean attention_mask [b, 1, s, s] (True = masked) for megatron-core.
    """
    b = len(bins)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_length)
    position_ids = torch.zeros(b, seq_length, dtype=torch.long)
    segment_ids = torch.full((b, seq_length), -1, dtype=torch.long)
    for row, members in enumerate(bins):
        pos = 0
        for seg, idx in enumerate(members):
            ids, mask = samples[idx]
            n = len(ids) - 1
            tokens[row, pos:pos + n] = torch.tensor(ids[:-1])
            labels[row, pos:pos + n] = torch.tensor(ids[1:])
            loss_mask[row, pos:pos + n] = torch.tensor(mask[1:], dtype=torch.float)
            position_ids[row, pos:pos + n] = torch.arange(n)
            segment_ids[row, pos:pos + n] = seg
            pos += n
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
    attention_mask = ~(same & causal)  # every position sees itself: softmax stays finite
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                segment_ids=segment_ids, attention_mask=attention_mask.unsqueeze(1))


def padding_fraction(lengths: Sequence[int], seq_length: int, packed: bool) -> float:
    """Fraction of bin slots that hold padding, packed or one sample per bin."""
    bins = pack_bins(lengths, seq_length, window=256 if packed else 1)
    used = sum(n - 1 for n in lengths)
    return 1.0 - used / (len(bins) * seq_length)
