"""Token-level negative log-likelihood on vocab-parallel logits (the SFT loss).

Megatron pads the vocabulary to a multiple of 128 x TP; the padded slots produce real
logits that would enter the softmax, so they are masked to -inf first.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [..., V/TP] with the slots of global index >= vocab_size set to -inf."""
    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    ids = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token NLL [b, s] of ``labels`` under vocab-parallel ``logits`` [b, s, V/TP] (fp32)."""
    logits = mask_padded_vocab(logits.float(), vocab_size)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
