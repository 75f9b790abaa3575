"""Context parallelism: each rank of the CP group holds a load-balanced slice of every sequence.

As megatron does (``get_batch_on_this_cp_rank``), a sequence is cut into ``2 x cp`` equal
chunks and CP rank ``r`` keeps chunks ``r`` and ``2cp - 1 - r``: under a causal mask the
early chunks attend to little and the late ones to much, so pairing one of each gives every
rank the same attention work. Attention across the slices is Transformer Engine's (GPU
only); the slicing, its inverse and the loss reductions here are plain tensor code.

Losses: each CP rank computes the loss of its own tokens divided by the GLOBAL normaliser
(all tokens of all micro-batches, all DP ranks); summing those shares over the CP group
(and the DP group) gives the loss of the whole mini-batch, so the gradient reduction over
the data-and-context-parallel group is exact.
"""

from __future__ import annotations

import torch

__all__ = ["cp_chunk_ids", "slice_for_cp_rank", "unslice_from_cp_ranks", "slice_batch",
           "THD_CP_UNSUPPORTED"]

# why packed (THD) micro-batches and context parallelism do not mix yet: said by validate()
THD_CP_UNSUPPORTED = ("packed (THD) micro-batches cannot be split over context-parallel ranks "
                      "yet (train/context_parallel.py slices padded [b, s] batches only)")


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


def slice_batch(batch: dict, cp: int, rank: int) -> dict:
    """A micro-batch with every per-token tensor ([b, s, ...], sequence on dim 1) sliced for
    this CP rank; other entries are kept. Packed (THD) micro-batches are refused: their
    per-sequence slicing is not implemented."""
    if cp == 1:
        return batch
    if "cu_seqlens" in batch:
        raise ValueError("--context-parallel-size > 1 with packed (THD) micro-batches is not "
                         "supported; use padded micro-batches")
    s = batch["tokens"].shape[1]
    return {k: slice_for_cp_rank(v, cp, rank) if torch.is_tensor(v) and v.dim() >= 2
            and v.shape[1] == s else v for k, v in batch.items()}
