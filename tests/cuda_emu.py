"""Emulated-CUDA test tier: csrc/cuda/vocab_logprobs.cu compiled as host C++ and run on the CPU.

The kernel source is compiled unchanged by g++ with ``-DKLEAR_CUDA_EMULATION`` (stand-ins for
the CUDA builtins and an emulated launch in csrc/emu/cuda_emu.h: fibers for the threads of a
block, barriers for __syncthreads, per-warp exchange slots for the shuffles) into a small shared
library, built on demand and cached under build/cuda_emu/ by a hash of the sources and flags
(~3 s of CPU per variant). ``KLEAR_MUTATION=k`` variants plant the bugs of the mutation test.

:class:`EmulatedOps` calls the library's ``klear_*_cuda`` launchers on CPU tensors with the
argument order of the real binding (csrc/cuda_binding.cpp, which does the same with device
pointers and the current stream). :func:`emulated_cuda` makes the fused op use it in place of
``torch.ops.klear`` so that the project's loss tests run the CUDA kernel source.

What this tier cannot see (see csrc/emu/cuda_emu.h): timing, the GPU memory model and warp
scheduling, hardware exp2 rounding, and everything in cuda_binding.cpp.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from megatron_klear.ops import vocab_parallel as op_module

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "cuda" / "vocab_logprobs.cu"
HEADERS = [ROOT / "csrc" / p for p in ("cuda/vocab_logprobs_cuda.h", "emu/cuda_emu.h",
                                        "policy_loss_math.h")]
BUILD_DIR = ROOT / "build" / "cuda_emu"
FLAGS = ["-x", "c++", "-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror",
         "-Wno-unknown-pragmas", "-DKLEAR_CUDA_EMULATION", f"-I{ROOT / 'csrc'}"]
MUTATIONS = {1: "wrong rescale of the sum", 2: "missing chunk offset",
             3: "dropped t >= 0 check", 4: "unrescaled entropy term"}
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # KlearDType


def _command(mutation: int, out: Path) -> list[str]:
    return ["g++", *FLAGS, f"-DKLEAR_MUTATION={mutation}", str(SOURCE), "-o", str(out)]


def library_path(mutation: int = 0) -> Path:
    """Where the (cached) library of this variant lives; depends on the sources and flags."""
    digest = hashlib.sha256()
    for path in [SOURCE, *HEADERS]:
        digest.update(path.read_bytes())
    digest.update(" ".join(_command(mutation, Path("x"))).encode())
    return BUILD_DIR / f"vocab_logprobs_emu_m{mutation}_{digest.hexdigest()[:16]}.so"


def build(mutations: list[int] = (0,)) -> dict[int, Path]:
    """Compile the variants not yet cached (in parallel); atomic: a finished file is complete."""
    paths = {m: library_path(m) for m in mutations}
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    jobs = []
    for m, path in paths.items():
        if path.exists():
            continue
        fd, tmp = tempfile.mkstemp(dir=BUILD_DIR, suffix=".so.tmp")
        os.close(fd)
        jobs.append((subprocess.Popen(_command(m, Path(tmp)), stderr=subprocess.PIPE, text=True),
                     Path(tmp), path))
    for proc, tmp, path in jobs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"emulated-CUDA build of {SOURCE.name} failed:\n{err}")
        os.replace(tmp, path)
        for stale in BUILD_DIR.glob(path.name.rsplit("_", 1)[0] + "_*.so"):  # older sources
            if stale != path:
                stale.unlink(missing_ok=True)
    return paths


class _TokenParams(ctypes.Structure):  # klear::TokenLossParams (csrc/policy_loss_math.h)
    _fields_ = [("type", ctypes.c_int), ("eps_low", ctypes.c_float),
                ("eps_high", ctypes.c_float), ("beta1", ctypes.c_float),
                ("beta2", ctypes.c_float), ("dual_clip", ctypes.c_float),
                ("erc_low", ctypes.c_float), ("erc_high", ctypes.c_float)]


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


class EmulatedOps:
    """``torch.ops.klear`` for CPU tensors, backed by the emulated CUDA launchers."""

    def __init__(self, mutation: int = 0):
        self.mutation = mutation
        self.lib = ctypes.CDLL(str(build([mutation])[mutation]))
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        self.lib.klear_logprob_stats_cuda.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, f32,
                                                      ptr, ptr]
        self.lib.klear_logprob_backward_cuda.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, ptr,
                                                         i64, f32, ptr, ptr, ptr, ptr, ptr]
        self.lib.klear_token_policy_loss_cuda.argtypes = [ptr, ptr, ptr, ptr, ptr, i64,
                                                          _TokenParams, ptr, ptr, ptr, ptr]
        self.lib.klear_emu_set_row_window.argtypes = [i64, i64]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"klear: {what} failed (cudaError {rc})")

    @staticmethod
    def _rows(logits: torch.Tensor, target_local: torch.Tensor) -> None:
        if logits.dim() != 2 or not logits.is_contiguous() or target_local.dtype != torch.int64:
            raise RuntimeError("klear: logits must be a contiguous [tokens, vocab_shard] tensor")

    def logprob_stats(self, logits, target_local, valid, inv_temp, *, raw=None) -> torch.Tensor:
        """Row stats [T, 4]; ``raw`` = (logits, target, stats) addresses overriding the tensors'
        (row-offset tests that address rows of a huge tensor inside a small buffer)."""
        self._rows(logits, target_local)
        stats = torch.empty(logits.shape[0], 4)
        x, t, s = raw or (_ptr(logits), _ptr(target_local), _ptr(stats))
        self._check(self.lib.klear_logprob_stats_cuda(DTYPE_CODE[logits.dtype], x,
                                                      logits.shape[0], logits.shape[1], t, valid,
                                                      inv_temp, s, None), "logprob_stats")
        return stats

    def _backward(self, logits, grad, target_local, lse, entropy, grad_logp, grad_entropy,
                  valid, inv_temp):
        self._rows(logits, target_local)
        lse, entropy, grad_logp = _f32(lse), _f32(entropy), _f32(grad_logp)
        ge = None if grad_entropy is None else _f32(grad_entropy)
        self._check(self.lib.klear_logprob_backward_cuda(
            DTYPE_CODE[logits.dtype], _ptr(logits), _ptr(grad), logits.shape[0], logits.shape[1],
            _ptr(target_local), valid, inv_temp, _ptr(lse), _ptr(entropy), _ptr(grad_logp),
            _ptr(ge), None), "logprob_backward")
        return grad

    def logprob_backward(self, logits, *args):
        return self._backward(logits, torch.empty_like(logits), *args)

    def logprob_backward_(self, logits, *args):
        return self._backward(logits, logits, *args)

    def token_policy_loss(self, logp, old_logp, adv, entropy, old_entropy, loss_type, eps_low,
                          eps_high, beta1, beta2, dual_clip, erc_low, erc_high):
        """As csrc/cuda_binding.cpp: ERC's band (erc_high > 0 enables it) rounded to float
        (op_checks.h token_params)."""
        if (entropy is not None) != (erc_high > 0):
            raise RuntimeError("klear: token_policy_loss needs entropy and old_entropy exactly "
                               "when erc_high > 0")
        erc = (erc_low, erc_high) if erc_high > 0 else (0.0, -1.0)
        loss, dlogp, ratio = (torch.empty_like(logp) for _ in range(3))
        params = _TokenParams(loss_type, eps_low, eps_high, beta1, beta2, dual_clip, *erc)
        self._check(self.lib.klear_token_policy_loss_cuda(
            _ptr(logp), _ptr(old_logp), _ptr(adv), _ptr(entropy), _ptr(old_entropy),
            logp.numel(), params, _ptr(loss), _ptr(dlogp), _ptr(ratio), None),
            "token_policy_loss")
        return loss, dlogp, ratio

    @contextlib.contextmanager
    def row_window(self, begin: int, end: int) -> Iterator[None]:
        """Launches run only the blocks with blockIdx.x in [begin, end)."""
        self.lib.klear_emu_set_row_window(begin, end)
        try:
            yield
        finally:
            self.lib.klear_emu_set_row_window(0, 2**62)


_LOADED: dict[int, EmulatedOps] = {}


def emulated_ops(mutation: int = 0) -> EmulatedOps:
    """The (cached) emulated ops of a variant."""
    if mutation not in _LOADED:
        _LOADED[mutation] = EmulatedOps(mutation)
    return _LOADED[mutation]


@contextlib.contextmanager
def emulated_cuda(mutation: int = 0) -> Iterator[EmulatedOps]:
    """Within the block, the fused ``cpu`` backend runs the emulated CUDA kernels."""
    ops = emulated_ops(mutation)
    saved = op_module._extension_ops
    op_module._extension_ops = lambda: ops
    try:
        yield ops
    finally:
        op_module._extension_ops = saved


@contextlib.contextmanager
def backend_for(name: str) -> Iterator[str]:
    """The op's backend for a test backend name: ``cuda-emu`` = ``cpu`` on the emulated kernels."""
    if name != "cuda-emu":
        yield name
        return
    with emulated_cuda():
        yield "cpu"
