"""Context parallelism in the trainer: each rank of the CP group holds a load-balanced slice of
every sequence of its micro-batches (which slice: models/context_parallel_layout.py).
Attention across the slices is Transformer Engine's (GPU only); the slicing, its inverse and
the loss reductions are plain tensor code.

Losses: each CP rank computes the loss of its own tokens divided by the GLOBAL normaliser
(all tokens of all micro-batches, all DP ranks); summing those shares over the CP group
(and the DP group) gives the loss of the whole mini-batch, so the gradient reduction over
the data-and-context-parallel group is exact.
"""

from __future__ import annotations

import torch

from megatron_klear.models.context_parallel_layout import slice_for_cp_rank

__all__ = ["slice_batch", "THD_CP_UNSUPPORTED"]

# why packed (THD) micro-batches and context parallelism do not mix yet: said by validate()
THD_CP_UNSUPPORTED = ("packed (THD) micro-batches cannot be split over context-parallel ranks "
                      "yet (train/context_parallel.py slices padded [b, s] batches only)")


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
