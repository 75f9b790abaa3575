"""Which slice of a sequence each context-parallel rank holds, and back.

As megatron does (``get_batch_on_this_cp_rank``), a sequence is cut into ``2 x cp`` equal
chunks and CP rank ``r`` keeps chunks ``r`` and ``2cp - 1 - r``: under a causal mask the
early chunks attend to little and the late ones to much, so pairing one of each gives every
rank the same attention work. The trainer slices its micro-batches so
(train/context_parallel.py); compare_logits (checkpoint/convert.py) slices its ids and
gathers the logits back the same way.
"""

from __future__ import annotations

import torch

__all__ = ["cp_chunk_ids", "slice_for_cp_rank", "unslice_from_cp_ranks"]


def cp_chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2 x cp`` sequence chunks that CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def slice_for_cp_rank(t: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's load-balanced slice of ``t`` along ``seq_dim`` (length / cp)."""
    if cp == 1:
        return t
    n = t.shape[seq_dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} is not a multiple of 2 x context-parallel size "
                         f"{cp}; pad it (--seq-length must be a multiple of {2 * cp})")
    chunks = t.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[i] for i in cp_chunk_ids(cp, rank)], dim=seq_dim)


def unslice_from_cp_ranks(slices: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's slice (rank order): the inverse of
    :func:`slice_for_cp_rank`."""
    cp = len(slices)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, s in enumerate(slices):
        lo, hi = s.chunk(2, dim=seq_dim)
        a, b = cp_chunk_ids(cp, rank)
        chunks[a], chunks[b] = lo, hi
    return torch.cat(chunks, dim=seq_dim)
