"""Reusable pieces of the strict virtual-CUDA tests (``KLEAR_STRICT_DEVICES=1``, see
megatron_klear/virtual_cuda.py): launching ranks in that mode, the CUDA loss kernels on the
virtual device, and megatron's CPU-offloading optimizer really offloading.

* :func:`run_strict` runs ``fn`` on gloo ranks whose platform plays a CUDA device: every tensor
  that would live on the GPU reports ``cuda``, ``torch.cuda.is_available()`` is True, pinned
  host memory is emulated, and an op CUDA torch would refuse raises ``DeviceMismatchError``.
* :func:`virtual_cuda_kernels` makes ``--loss-backend cuda`` (and ``auto``) dispatch to the
  CUDA kernel source compiled for the host (tests/cuda_emu.py) behind the device checks of
  the real binding (csrc/cuda_binding.cpp with csrc/op_checks.h: every tensor on the logits'
  device, outputs allocated there).
* :func:`offloaded_copies` returns the pinned CPU copies that megatron's
  ``HybridDeviceOptimizer`` (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) made
  of the parameters it offloaded, so a test can assert that the offload happened (it copies
  only parameters that report ``is_cuda``, into ``pin_memory()`` tensors: on a plain CPU run
  it offloads nothing). Trainer offload tests (colocation) build on it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch

from megatron_klear import platform
from megatron_klear.virtual_cuda import STRICT_ENV
from tests.dist import run_distributed


def run_strict(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list:
    """``run_distributed`` with the strict virtual-CUDA platform on every rank."""
    mp = pytest.MonkeyPatch()
    mp.setenv(STRICT_ENV, "1")  # the spawned ranks inherit it
    try:
        return run_distributed(fn, world_size, *args, timeout=timeout)
    finally:
        mp.undo()


def caught(step: Callable[[], Any]) -> str | None:
    """The message of the exception ``step`` raises (type name first), or None."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - a sub-check's failure is its result
        return f"{type(exc).__name__}: {exc}"
    return None


class VirtualCudaOps:
    """``torch.ops.klear``'s CUDA kernels for tensors on the virtual CUDA device: the device
    checks of csrc/op_checks.h, the emulated kernel, outputs on the logits' device."""

    def __init__(self) -> None:
        from tests.cuda_emu import emulated_ops

        self.emu = emulated_ops()

    @staticmethod
    def _on(device: torch.device, what: str, *tensors) -> None:
        for t in tensors:
            if t is not None and t.device != device:
                raise RuntimeError(f"klear: {what} must be on the logits' device {device}; "
                                   f"got {t.device}")

    def logprob_stats(self, logits, target_local, valid, inv_temp):
        self._on(platform.device(), "logits", logits)
        self._on(logits.device, "target_local", target_local)
        return self.emu.logprob_stats(logits, target_local, valid, inv_temp).to(logits.device)

    def _backward(self, name, logits, target_local, lse, entropy, grad_logp, grad_entropy,
                  valid, inv_temp):
        self._on(logits.device, "target_local, lse, entropy, grad_logp, grad_entropy",
                 target_local, lse, entropy, grad_logp, grad_entropy)
        return getattr(self.emu, name)(logits, target_local, lse, entropy, grad_logp,
                                       grad_entropy, valid, inv_temp)

    def logprob_backward(self, *args):
        return self._backward("logprob_backward", *args)

    def logprob_backward_(self, *args):
        return self._backward("logprob_backward_", *args)

    def token_policy_loss(self, logp, old_logp, adv, entropy, old_entropy, *rest):
        self._on(platform.device(), "logp", logp)
        self._on(logp.device, "old_logp, adv, entropy, old_entropy", old_logp, adv, entropy,
                 old_entropy)
        out = self.emu.token_policy_loss(logp, old_logp, adv, entropy, old_entropy, *rest)
        return tuple(t.to(logp.device) for t in out)


@contextlib.contextmanager
def virtual_cuda_kernels() -> Iterator[VirtualCudaOps]:
    """Within the block the extension 'has' its CUDA kernels: :class:`VirtualCudaOps`."""
    from megatron_klear.ops import vocab_parallel as op_module

    ops = VirtualCudaOps()
    saved = op_module._extension_ops, op_module._extension_has_cuda
    op_module._extension_ops, op_module._extension_has_cuda = (lambda: ops), (lambda: True)
    try:
        yield ops
    finally:
        op_module._extension_ops, op_module._extension_has_cuda = saved


def offloaded_copies(optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """{GPU parameter (shard): its CPU copy} of every HybridDeviceOptimizer in ``optimizer``
    (chained or not; empty when nothing was offloaded)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    out: dict[torch.Tensor, torch.Tensor] = {}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            out.update(inner.gpu_params_map_cpu_copy)
    return out
