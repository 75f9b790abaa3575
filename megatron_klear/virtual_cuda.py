"""The strict virtual-CUDA mode: test machinery kept apart from the CUDA-less real run.

Strict device mode (``KLEAR_STRICT_DEVICES=1``, for tests): the CPU emulation of
megatron_klear/platform.py additionally plays a *virtual CUDA device*. Every tensor that would live on the GPU on a GPU machine is
tagged (by storage) as CUDA: tensors created or moved with a device naming CUDA, and the
outputs of every op with a CUDA input (a ``TorchDispatchMode`` sees every aten op, in forward,
backward, recompute and optimizer steps alike). Such tensors report ``device.type == "cuda"``
and :func:`megatron_klear.platform.device` returns ``cuda:LOCAL_RANK``, so the code under test takes its GPU path. An
op that mixes CUDA and CPU tensors where CUDA torch would refuse (anything but copies, CPU
scalars and CPU index tensors), or a collective on a CPU tensor (NCCL refuses those) outside a
:func:`host_collective` (a gloo group's collective, which moves host tensors), raises
:class:`DeviceMismatchError`. ``torch.cuda.is_available()`` answers True, as on a GPU machine
(code that asks torch instead of platform.py takes its GPU branch too). With platform.py's
emulated pinned host memory (``pin_memory()``, ``pin_memory=True``, ``is_pinned()``), megatron's
CPU-offloading optimizer really offloads: it keeps pinned CPU copies of every parameter that
reports ``is_cuda``. See tests/multiprocess/test_placement.py and tests/virtual_cuda.py.

The virtual device has an index and a memory (issue 38): tagged tensors report
``cuda:LOCAL_RANK``; :func:`megatron_klear.platform.gpu_uuid` names the GPU behind an index as CUDA does, through
``CUDA_VISIBLE_DEVICES`` (a tensor handle carries it, as SGLang's device-UUID reductions
make it, and a receiver that does not see that GPU refuses it: :func:`megatron_klear.platform.gpu_index_of_uuid`);
the bytes of the tagged storages are counted (allocation, resize, free), so
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` /
``mem_get_info`` answer for the virtual GPU, and with ``KLEAR_VIRTUAL_GPU_MEMORY_GB`` set an
allocation beyond it raises ``torch.OutOfMemoryError`` as CUDA's allocator does.

:func:`megatron_klear.platform.setup` calls :func:`install` when :func:`active`; its cuda -> cpu
mode asks :func:`target_device` and :func:`tag_result` where a call names a device. Nothing here
runs on a GPU machine or in a plain CPU run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["STRICT_ENV", "VIRTUAL_MEMORY_ENV", "DeviceMismatchError", "active", "install",
           "host_collective", "is_virtual_cuda", "share_memory", "storage_of", "target_device",
           "tag_result", "DEVICE_QUERIES"]

STRICT_ENV = "KLEAR_STRICT_DEVICES"
VIRTUAL_MEMORY_ENV = "KLEAR_VIRTUAL_GPU_MEMORY_GB"  # strict mode: the virtual GPU's size
_TORCH_CUDA_AVAILABLE = torch.cuda.is_available  # install() replaces the attribute


def active() -> bool:
    """Strict device mode is on: no real CUDA and ``KLEAR_STRICT_DEVICES=1``."""
    return not _TORCH_CUDA_AVAILABLE() and os.environ.get(STRICT_ENV, "0") == "1"


def device() -> torch.device:
    """The virtual GPU: this process's ``cuda:LOCAL_RANK``."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def storage_of(t: torch.Tensor):
    """``t``'s untyped storage, or None (storage-less layouts, empty storages)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None
    return storage if storage.nbytes() else None


def _names_cuda(dev) -> bool | None:
    """True/False when ``dev`` is a device spec naming CUDA/another device; None otherwise."""
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True
    return None


def target_device(func, args, kwargs) -> bool | None:
    """Whether a call places its result on CUDA (True), elsewhere (False), or inherits (None)."""
    if func is torch.Tensor.cuda:
        return True
    if func is torch.Tensor.cpu:
        return False
    if "device" in kwargs and kwargs["device"] is not None:
        return _names_cuda(kwargs["device"])
    if func is torch.Tensor.to and len(args) > 1:
        if torch.is_tensor(args[1]):
            return _TAGS.is_cuda(args[1])
        return _names_cuda(args[1])
    if func is torch.Tensor.new_tensor:
        return _TAGS.is_cuda(args[0])
    return None


def _is_move(func) -> bool:
    return func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


class DeviceMismatchError(RuntimeError):
    """An op that would mix CUDA and CPU tensors on a GPU machine (strict device mode)."""


class _DeviceTags:
    """Which storages would live on the GPU (CPU is the default).

    Keyed by the storage's Python object, which torch keeps alive exactly as long as the
    storage itself; a weak reference drops the tag when the storage is freed, so a new
    storage at a recycled address never inherits a stale tag.
    """

    def __init__(self) -> None:
        self.cuda: dict[int, weakref.ref] = {}
        self.sizes: dict[int, int] = {}  # bytes of each tagged storage, as last counted
        self.allocated = self.peak = 0  # bytes on the virtual GPU now, and the peak
        self.limit: int | None = None  # the virtual GPU's size (KLEAR_VIRTUAL_GPU_MEMORY_GB)
        # CUDA IPC (torch/csrc/CudaIPCTypes.cpp): a block whose handle was sent to another
        # process is, once freed here, kept in torch's "sent data limbo" until
        # torch.cuda.ipc_collect(); empty_cache() does not free it. Keys of the storages
        # shared by handle, the bytes freed but not collected, and how many were ever shared.
        self.ipc: set[int] = set()
        self.limbo = self.shared_count = 0

    def _count(self, key: int, nbytes: int) -> None:
        """Set the counted bytes of storage ``key``; raise as CUDA's allocator does when the
        virtual GPU's size is exceeded."""
        grow = nbytes - self.sizes.get(key, 0)
        if grow > 0 and self.limit is not None and self.allocated + grow > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (virtual GPU {device()}): tried to allocate {grow} bytes "
                f"with {self.allocated} of {self.limit} allocated ({VIRTUAL_MEMORY_ENV})")
        self.allocated += grow
        self.sizes[key] = nbytes
        self.peak = max(self.peak, self.allocated)

    def _forget(self, key: int) -> None:
        self.cuda.pop(key, None)
        self.allocated -= self.sizes.pop(key, 0)

    def _freed(self, key: int) -> None:
        """A tagged storage died: its bytes are free, or in the IPC limbo if it was shared."""
        if key in self.ipc:
            self.ipc.discard(key)
            self.cuda.pop(key, None)
            self.limbo += self.sizes.pop(key, 0)  # still in ``allocated`` until collected
        else:
            self._forget(key)

    def ipc_collect(self) -> None:
        """``torch.cuda.ipc_collect()``: the limbo's blocks are freed (the twin's receivers,
        the embedded servers, drop their mappings before they answer)."""
        self.allocated -= self.limbo
        self.limbo = 0

    def resized(self, storage) -> None:
        """Count a tagged storage's new size (``UntypedStorage.resize_``: offload's way to free
        and re-allocate device memory)."""
        ref = self.cuda.get(id(storage))
        if ref is not None and ref() is storage:
            self._count(id(storage), storage.nbytes())

    def is_cuda(self, t: torch.Tensor) -> bool:
        storage = storage_of(t)
        ref = self.cuda.get(id(storage)) if storage is not None else None
        return ref is not None and ref() is storage

    def set(self, out, on_cuda: bool) -> None:
        for t in tree_leaves(out):
            storage = storage_of(t) if torch.is_tensor(t) else None
            if storage is None:
                continue
            key = id(storage)
            ref = self.cuda.get(key)
            if on_cuda and (ref is None or ref() is not storage):
                self._forget(key)  # a dead storage's tag at a recycled address
                self._count(key, storage.nbytes())
                self.cuda[key] = weakref.ref(storage, lambda _, k=key: self._freed(k))
            elif not on_cuda and ref is not None:
                self._forget(key)


_TAGS = _DeviceTags()



DEVICE_QUERIES = {  # the virtual device is this process's GPU, cuda:LOCAL_RANK
    torch.Tensor.device.__get__: lambda t: device() if _TAGS.is_cuda(t) else t.device,
    torch.Tensor.is_cuda.__get__: lambda t: _TAGS.is_cuda(t) or t.is_cuda,
    torch.Tensor.get_device: lambda t: device().index if _TAGS.is_cuda(t) else t.get_device(),
}


def is_virtual_cuda(t: torch.Tensor) -> bool:
    """True for a tensor of the strict mode's virtual GPU (host memory that plays CUDA)."""
    return active() and _TAGS.is_cuda(t)


def share_memory(t: torch.Tensor) -> torch.Tensor:
    """``t.share_memory_()`` (host memory another process can map by handle), keeping a
    virtual-CUDA tensor on its virtual GPU (sharing gives it a new storage)."""
    virtual = is_virtual_cuda(t)
    t.share_memory_()
    if virtual:
        _TAGS.set(t, True)
    return t
# ops CUDA torch runs across devices: copies, and indexing with CPU index tensors
_CROSS_DEVICE = {"aten::copy_", "aten::_to_copy", "aten::index.Tensor", "aten::index_put_",
                 "aten::index_put", "aten::_index_put_impl_", "aten::set_"}


def ipc_shared(t: torch.Tensor) -> None:
    """``t``'s storage was handed to another process by handle (its handle pickled), so once
    freed it stays allocated until ``torch.cuda.ipc_collect()``."""
    storage = storage_of(t)
    if is_virtual_cuda(t) and storage is not None:
        _TAGS.ipc.add(id(storage))
        _TAGS.shared_count += 1


def ipc_limbo_bytes() -> int:
    """Bytes of blocks shared by handle, freed and not yet ``ipc_collect``-ed."""
    return _TAGS.limbo


def ipc_shared_count() -> int:
    """How many handles of virtual-GPU memory this process has made."""
    return _TAGS.shared_count


def _in_object_collective() -> bool:
    """True inside torch's *_object collectives, which pick the tensor device from the backend."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name.endswith(("_object", "_object_list")) and \
                frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


class _DeviceCheckMode(TorchDispatchMode):
    """Propagates CUDA tags through every aten op and raises where CUDA torch would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_cuda = [_TAGS.is_cuda(t) for t in tensors]
        name = func.name()
        if name.startswith("c10d::") and name != "c10d::barrier":  # torch makes its tensor
            if not all(on_cuda[i] or not t.numel() for i, t in enumerate(tensors)) and \
                    not getattr(_HOST_COLLECTIVE, "depth", 0) and not _in_object_collective():
                raise DeviceMismatchError(
                    f"{name} on a CPU tensor: NCCL (the GPU backend) only moves CUDA tensors")
        elif any(on_cuda) and name not in _CROSS_DEVICE:
            cpu = [tuple(t.shape) for t, c in zip(tensors, on_cuda) if not c and t.dim()]
            if cpu:
                raise DeviceMismatchError(
                    f"{name} mixes CUDA tensors with CPU tensors of shapes {cpu}: on a GPU "
                    "machine this op fails (a tensor was not moved to platform.device())")
        out = func(*args, **kwargs)
        if name in ("aten::copy_", "aten::set_"):
            return out
        _TAGS.set(out, any(on_cuda))
        return out



def _count_virtual_memory() -> None:
    """Strict mode: the virtual GPU's size from ``KLEAR_VIRTUAL_GPU_MEMORY_GB``, and storage
    resizes counted (``UntypedStorage.resize_`` is no aten op the dispatch mode sees)."""
    size = os.environ.get(VIRTUAL_MEMORY_ENV)
    _TAGS.limit = int(float(size) * 2**30) if size else None
    resize = torch.UntypedStorage.resize_

    def resize_(self, size):
        out = resize(self, size)
        _TAGS.resized(self)
        return out

    torch.UntypedStorage.resize_ = resize_


_HOST_COLLECTIVE = threading.local()


@contextlib.contextmanager
def host_collective() -> Iterator[None]:
    """Collectives issued inside run on a gloo group (e.g. the weight-update group with a CPU
    rollout server), which moves host tensors on GPU machines too: strict device mode does not
    ask for CUDA tensors there. No-op otherwise."""
    depth = getattr(_HOST_COLLECTIVE, "depth", 0)
    _HOST_COLLECTIVE.depth = depth + 1
    try:
        yield
    finally:
        _HOST_COLLECTIVE.depth = depth



def tag_result(func, args, out, target: bool):
    """Tag the result of a call that placed it on the virtual GPU (``target`` True) or off it
    (:func:`target_device`); a real device move copies, so the source keeps its device."""
    if _is_move(func) and _TAGS.is_cuda(args[0]) != target and \
            out.untyped_storage() is args[0].untyped_storage():
        out = out.clone()
    _TAGS.set(out, target)
    return out


def install() -> TorchDispatchMode:
    """Play the virtual GPU in this process: ``torch.cuda.is_available()`` answers True, the
    CUDA memory queries count the tagged storages, and the device check sees every aten op
    (returned, entered)."""
    torch.cuda.is_available = lambda: True  # the virtual device is a CUDA device
    cuda = torch.cuda
    cuda.memory_allocated = lambda *a, **k: _TAGS.allocated
    cuda.max_memory_allocated = lambda *a, **k: _TAGS.peak
    cuda.reset_peak_memory_stats = lambda *a, **k: setattr(_TAGS, "peak", _TAGS.allocated)
    cuda.mem_get_info = lambda *a, **k: (
        (_TAGS.limit - _TAGS.allocated, _TAGS.limit) if _TAGS.limit is not None else (0, 0))
    cuda.ipc_collect = _TAGS.ipc_collect  # empty_cache leaves the IPC limbo, as CUDA's does
    _count_virtual_memory()
    check = _DeviceCheckMode()
    check.__enter__()
    return check
