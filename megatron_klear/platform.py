"""Device and backend choice, and the CPU emulation of megatron-core's CUDA calls.

megatron-core hard-codes ``device="cuda"``, ``torch.cuda.current_device()`` and CUDA RNG
state in many places. On a machine without CUDA, :func:`setup` installs a small emulation
layer so that the *real* megatron-core stack (GPTModel, schedules, DDP, optimizer,
dist_checkpointing) runs on CPU under gloo:

* a global ``TorchFunctionMode`` that maps device ``"cuda"`` to ``"cpu"`` in tensor
  factories, ``Tensor.to`` and ``Tensor.cuda``;
* ``torch.cuda.current_device`` / ``synchronize`` / stream stubs;
* CUDA RNG get/set/seed redirected to the CPU generator, which megatron's RNG tracker uses;
* no-argument ``Tensor.type()`` reporting a cuda type name (megatron's grad clipping asserts it).

This is the ONLY module that knows the trainer may run without CUDA; everything else is
written as if on GPU. :func:`setup` is idempotent.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Platform", "setup", "cuda_available", "device", "backend", "is_emulated"]


def cuda_available() -> bool:
    """True when a real CUDA device can be used."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device the trainer computes on (cuda:LOCAL_RANK on GPU, cpu otherwise)."""
    if cuda_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend() -> str:
    """torch.distributed backend: nccl on CUDA, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"


def _redirect(dev):
    """Map a device spec naming CUDA to the CPU; leave anything else unchanged."""
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str):
        return "cpu" if dev.split(":")[0] == "cuda" else dev
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"
    return dev


_TO = {torch.Tensor.to}
_CUDA_METHODS = {torch.Tensor.cuda}


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects every tensor creation or move that names CUDA to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CUDA_METHODS:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _redirect(kwargs["device"])
        if func in _TO:
            args = tuple(_redirect(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
                args = (args[0], "cpu") + args[2:]
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _CUDA_TYPE_NAMES.get(self.dtype, original(self))
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _patch_cuda_module() -> None:
    """Stubs for the torch.cuda calls megatron-core makes outside tensor creation."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream  # a class: annotations like `torch.cuda.Stream | None` work
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.Event = _NullEvent
    # RNG: megatron's tracker keeps "CUDA" generator states; the CPU generator stands in.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


class _NullStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def wait_stream(self, other) -> None:  # noqa: D102
        pass

    def wait_event(self, event) -> None:  # noqa: D102
        pass

    def record_event(self, event=None):  # noqa: D102
        return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:  # noqa: D102
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def wait(self, stream=None) -> None:  # noqa: D102
        pass

    def query(self) -> bool:  # noqa: D102
        return True

    def elapsed_time(self, other) -> float:  # noqa: D102
        return 0.0


@dataclass(frozen=True)
class Platform:
    """What :func:`setup` chose."""

    device: torch.device
    backend: str
    emulated: bool


_STATE: dict = {}


def setup() -> Platform:
    """Choose device/backend and, without CUDA, install the CPU emulation once."""
    if "platform" in _STATE:
        return _STATE["platform"]
    emulated = not cuda_available()
    if emulated:
        _patch_cuda_module()
        _patch_megatron_rng()
        _patch_tensor_type()
        mode = _CudaToCpuMode()
        mode.__enter__()  # global for the process: megatron creates tensors everywhere
        _STATE["mode"] = mode
    else:
        torch.cuda.set_device(device())
    _STATE["platform"] = Platform(device=device(), backend=backend(), emulated=emulated)
    return _STATE["platform"]


def is_emulated() -> bool:
    """True once :func:`setup` installed the CPU emulation."""
    return "platform" in _STATE and _STATE["platform"].emulated
