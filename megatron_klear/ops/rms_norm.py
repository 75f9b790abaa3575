"""RMSNorm, forward and backward in one pass per row on the CPU.

torch's CPU ``rms_norm`` is eight ops forward and its autograd about twenty backward; the
extension's ``klear::rms_norm`` / ``klear::rms_norm_backward`` (csrc/cpu/rms_norm_cpu.h) do each
in one pass. fp32 CPU tensors take them; anything else (CUDA, bf16, no extension) runs torch's
``F.rms_norm``, the reference the kernels are tested against (tests/multiprocess/test_rms_norm_op.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_klear.ops import vocab_parallel

__all__ = ["rms_norm"]


class _FusedRMSNorm(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (rows kept for the
    backward, which recomputes the per-row scale)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.eps = eps
        return vocab_parallel._extension_ops().rms_norm(rows, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        rows, weight = ctx.saved_tensors
        dx, dw = vocab_parallel._extension_ops().rms_norm_backward(
            dy.reshape(rows.shape).contiguous(), rows, weight, ctx.eps)
        return dx.view(dy.shape), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` over its last dimension, scaled by ``weight``: the fused kernels for
    fp32 CPU tensors, torch's ``F.rms_norm`` otherwise."""
    ops = vocab_parallel._extension_ops() if (
        x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
        and weight.device.type == "cpu" and x.stride(-1) == 1) else None
    if ops is None:
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedRMSNorm.apply(x, weight, eps)
    # no graph to record (the decode): the kernel alone, without autograd's per-call cost
    return ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
