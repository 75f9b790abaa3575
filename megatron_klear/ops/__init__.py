"""Fused kernels (Python side) and their pure-torch references."""

from megatron_klear.ops.loss_math import PolicyLossSpec
from megatron_klear.ops.vocab_parallel import (PolicyLossOutput, available_backends,
                                               resolve_backend, vocab_parallel_gather_logits,
                                               vocab_parallel_logprobs,
                                               vocab_parallel_policy_loss)

__all__ = ["PolicyLossOutput", "PolicyLossSpec", "vocab_parallel_policy_loss",
           "vocab_parallel_logprobs", "vocab_parallel_gather_logits",
           "available_backends", "resolve_backend"]
