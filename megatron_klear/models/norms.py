"""RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec.

megatron-core's local spec builds its norms through ``WrappedTorchNorm``, which refuses
sequence parallelism ("sequence parallel not supported by torch LayerNorm"). The norm itself
does not care: RMSNorm normalises each token over the hidden dimension, so a
sequence-sharded input ``[s/TP, b, h]`` gives the same per-token result. What sequence
parallelism needs is the gradient of the (replicated) weight summed over the TP group, since
each rank sees only its slice of the tokens. megatron's ``finalize_model_grads`` all-reduces
exactly the parameters marked ``sequence_parallel=True`` (Transformer Engine's TENorm marks
its weight the same way), so :class:`RMSNorm` marks its weight when the config asks for SP.

The q/k norms act on attention heads after the QKV projection has gathered the full
sequence; they are never sequence-sharded, and megatron reduces their grads over TP by name.
They use ``RMSNorm`` with ``sequence_parallel_weight=False`` (see :func:`norm_specs`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_klear.ops.rms_norm import rms_norm

__all__ = ["RMSNorm", "norm_specs"]


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm built on the model's device and dtype, with megatron's SP weight marker;
    its forward is :func:`megatron_klear.ops.rms_norm.rms_norm` (fused CPU kernels)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6,
                 sequence_parallel_weight: bool = True, **_unused) -> None:
        super().__init__(hidden_size, eps=eps, device=torch.cuda.current_device(),
                         dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel and
                                             sequence_parallel_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def norm_specs() -> tuple[ModuleSpec, ModuleSpec]:
    """(hidden-state norm, q/k head norm) specs for the local layer spec."""
    return (ModuleSpec(module=RMSNorm),
            ModuleSpec(module=RMSNorm, params={"sequence_parallel_weight": False}))
