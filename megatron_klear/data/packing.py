"""Sequence packing: several samples per fixed-length bin, with no attention across them.

A bin holds whole samples in order. Each sample contributes ``len - 1`` next-token
positions; position ids restart at 0 for every sample, and the attention mask is
block-diagonal causal, so a packed sample sees exactly what it would see alone.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pack_greedy(lengths: Sequence[int], bin_size: int) -> list[list[int]]:
    """Group sample indices, in order, into bins whose token counts fit ``bin_size``.

    Order is kept (a sample never moves ahead of an earlier one), so the data position of
    a run is simply the number of bins consumed.
    """
    bins: list[list[int]] = []
    used = bin_size + 1
    for i, n in enumerate(lengths):
        need = n - 1  # next-token positions
        if need > bin_size:
            raise ValueError(f"sample {i} has {n} tokens, more than the bin ({bin_size} + 1)")
        if used + need > bin_size:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += need
    return bins


def build_packed_batch(samples: Sequence[tuple[list[int], list[int]]], bins: Sequence[Sequence[int]],
                       seq_length: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A micro-batch [len(bins), seq_length] from (input_ids, loss_mask) samples.

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
    bins = pack_greedy(lengths, seq_length) if packed else [[i] for i in range(len(lengths))]
    used = sum(n - 1 for n in lengths)
    return 1.0 - used / (len(bins) * seq_length)
