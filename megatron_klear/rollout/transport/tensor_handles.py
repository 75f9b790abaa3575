"""SGLang's ``update_weights_from_tensor`` payload: tensors passed by handle, not by value.

A colocated trainer hands an engine on the same node its weights as torch multiprocessing
handles: the tensor's storage is shared (CUDA IPC on a GPU, a shared-memory file on a CPU)
and only the handle travels in the HTTP body. The body is SGLang 0.5.23's
(``UpdateWeightsFromTensorReqInput``, sglang/srt/managers/io_struct.py):
``serialized_named_tensors`` holds one base64 string per engine TP rank, each a
``MultiprocessingSerializer`` pickle (``ForkingPickler``, sglang/srt/utils/common.py). With
``load_format="flattened_bucket"`` the pickled object is ``{"flattened_tensor": uint8
tensor, "metadata": [FlattenedTensorMetadata, ...]}``
(sglang/srt/model_executor/model_runner_components/weight_updater.py,
``_update_weights_from_flattened_bucket``; sglang/srt/weight_sync/tensor_bucket.py).

The trainer does not import SGLang, so :class:`FlattenedTensorMetadata` here has SGLang's
fields and :func:`serialize_bucket` writes it into the pickle under SGLang's name
(``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``): SGLang's
``SafeUnpickler`` allows exactly that global. :func:`deserialize` is the embedded server's
reading of the same bytes, with an allow-list as SGLang's (no arbitrary globals).

CPU tensors are shared with torch's ``file_system`` strategy (``rebuild_storage_filename``,
also on SGLang's allow-list): the default ``file_descriptor`` strategy passes a descriptor
through ``multiprocessing.resource_sharer``, which only a child process of the sender can
collect (it authenticates with the parent's key); an engine is not the trainer's child.

CUDA tensors are pickled with SGLang's device-UUID reduction applied on the sender
(``monkey_patch_torch_reductions``, sglang/srt/utils/patch_torch.py): torch's
``rebuild_cuda_tensor`` (torch/multiprocessing/reductions.py, ``reduce_tensor``: 15 arguments,
the device index the 7th) with the GPU's UUID in the device slot, so an engine that numbers
its GPUs otherwise (``CUDA_VISIBLE_DEVICES``) maps the right one, and one that does not see it
refuses it ("Invalid device_uuid"). A tensor of the strict virtual-CUDA mode (virtual_cuda.py:
host memory that plays a GPU) is pickled the same way -- same function, same argument
layout, its virtual GPU's UUID in the same slot -- with its host shared-memory name where
CUDA puts its IPC handle. The embedded server's :class:`_Unpickler` maps the UUID to a local
device as SGLang's ``_rebuild_cuda_tensor_modified`` / ``_device_from_maybe_uuid`` do, then
opens the memory (a CUDA IPC handle with CUDA, the shared-memory name without).
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions

from megatron_klear import platform, virtual_cuda

__all__ = ["FlattenedTensorMetadata", "serialize_bucket", "deserialize", "bucket_tensors",
           "shared_buffer", "release_buffer", "SGLANG_METADATA"]

# where SGLang 0.5.23 defines the metadata class (its SafeUnpickler allows this global)
SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket: SGLang's fields and meaning (byte offsets in the
    uint8 ``flattened_tensor``; ``numel`` counts bytes, as SGLang's)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_CUDA_DEVICE_ARG = 6  # rebuild_cuda_tensor's device index (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)
_CUDA_HANDLE_ARG = 7  # its storage handle (a CUDA IPC handle; the strict mode's: see below)
_NAME_SEP = b"\0"  # between the manager's and the storage's shared-memory names


def _reduce_tensor(t: torch.Tensor):
    """torch's reduction of ``t`` with its GPU named by UUID (SGLang's
    ``_reduce_tensor_modified``); a virtual-CUDA tensor as the same ``rebuild_cuda_tensor``
    call, its storage handle the host shared-memory names (``_share_filename_cpu_``, as
    torch's ``file_system`` reduction)."""
    if virtual_cuda.is_virtual_cuda(t):
        storage = t._typed_storage()
        manager, name, nbytes = storage._untyped_storage._share_filename_cpu_()
        storage._untyped_storage._shared_incref()  # the receiver's rebuild decrefs (torch's)
        virtual_cuda.ipc_shared(t)
        return reductions.rebuild_cuda_tensor, (
            type(t), t.size(), t.stride(), t.storage_offset(), type(storage), t.dtype,
            platform.gpu_uuid(t.device.index), manager + _NAME_SEP + name, nbytes, 0,
            t.requires_grad, None, 0, None, False)
    fn, args = reductions.reduce_tensor(t)
    if fn is reductions.rebuild_cuda_tensor:
        args = (*args[:_CUDA_DEVICE_ARG], platform.gpu_uuid(args[_CUDA_DEVICE_ARG]),
                *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def _rebuild_cuda_tensor(*args) -> torch.Tensor:
    """The receiver's ``rebuild_cuda_tensor``, as SGLang's ``_rebuild_cuda_tensor_modified``
    (sglang/srt/utils/patch_torch.py): a UUID in the device slot becomes this process's index
    of that GPU, refused ("Invalid device_uuid") when this process does not see it
    (``_device_from_maybe_uuid``); then torch's rebuild with CUDA, or, without CUDA (the
    strict mode's virtual GPU), the host shared memory the handle names."""
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        device = platform.gpu_index_of_uuid(device)
    elif not isinstance(device, int):
        raise pickle.UnpicklingError(f"Unknown type: device_maybe_uuid={device!r}")
    args = (*args[:_CUDA_DEVICE_ARG], device, *args[_CUDA_DEVICE_ARG + 1:])
    if platform.cuda_available():
        return reductions.rebuild_cuda_tensor(*args)
    cls, size, stride, offset, _, dtype, _, handle, nbytes = args[:9]
    if not isinstance(handle, bytes) or _NAME_SEP not in handle:
        raise pickle.UnpicklingError("a CUDA tensor handle reached a process without CUDA: "
                                     "only the strict virtual-CUDA mode's handles map here")
    manager, name = handle.split(_NAME_SEP, 1)
    storage = reductions.rebuild_storage_filename(torch.UntypedStorage, manager, name, nbytes)
    t = torch._utils._rebuild_tensor(
        torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True),
        offset, size, stride)
    return t if cls is torch.Tensor else t.as_subclass(cls)


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    """``ForkingPickler`` (torch's tensor reductions, the GPU named by UUID) that writes
    :class:`FlattenedTensorMetadata` as SGLang's class."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = ForkingPickler._copyreg_dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)
        self.dispatch_table[torch.Tensor] = _reduce_tensor

    def save_global(self, obj, name=None):  # noqa: D102
        if obj is FlattenedTensorMetadata:
            self.save(SGLANG_METADATA[0])
            self.save(SGLANG_METADATA[1])
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """torch's ``file_system`` sharing strategy for the pickles made inside (see module doc)."""
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer whose handle can be passed to another process, until
    :func:`release_buffer`. Host memory (a CPU trainer, or the strict mode's virtual GPU): in
    shared memory (``file_system``) with one reference kept by this process: torch unlinks a
    shared-memory file when its count drops to zero, which happens as soon as a receiver drops
    the tensors of the first payload (measured: a second payload of the same buffer then
    fails with ``No such file or directory``). CUDA: a plain allocation (CUDA IPC keeps the
    block alive while a receiver maps it)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if buf.untyped_storage().device.type == "cpu":
        with _file_system_sharing():
            virtual_cuda.share_memory(buf)
        buf.untyped_storage()._shared_incref()
    return buf


def release_buffer(buf: torch.Tensor) -> None:
    """Give up this process's extra reference of a :func:`shared_buffer` (its shared-memory
    file goes when the last tensor does). On CUDA nothing: dropping the tensor hands the block
    to torch's IPC limbo, which frees it only once every receiver has released it, after the
    receiver's stream synchronize (torch/csrc/StorageSharing.cpp)."""
    if buf.untyped_storage().device.type == "cpu":
        buf.untyped_storage()._shared_decref()


def serialize_bucket(flat: torch.Tensor, specs: list[tuple[str, tuple, torch.dtype, int]]
                     ) -> str:
    """The base64 ``MultiprocessingSerializer`` string of a flattened bucket: ``flat`` (uint8,
    shared by handle: the receiver maps the same memory; a :func:`shared_buffer`) and
    ``specs`` as (name, shape, dtype, byte offset). One payload serves one receiver (one
    engine TP rank): each pickle takes the reference its receiver gives back."""
    metadata = []
    for name, shape, dtype, offset in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, torch.Size(shape), dtype, offset,
                                                offset + size, size))
    buf = io.BytesIO()
    with _file_system_sharing():
        _Pickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _Unpickler(pickle.Unpickler):
    """Reads SGLang's payloads: torch's tensor rebuild functions and plain containers only,
    as SGLang's ``SafeUnpickler`` (sglang/srt/utils/common.py); SGLang's metadata class
    becomes :class:`FlattenedTensorMetadata`."""

    ALLOWED = {("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_storage_filename", "rebuild_storage_empty",
        "rebuild_typed_storage", "rebuild_storage_fd")} | {
        ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"), ("torch", "Size"),
        ("torch", "Tensor"), ("torch", "device"), ("torch", "dtype"), ("copyreg", "__newobj__"),
        ("copyreg", "_reconstructor"), ("builtins", "object"), ("collections", "OrderedDict"),
        ("multiprocessing.resource_sharer", "DupFd"), ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.storage", "TypedStorage")}
    # CUDA handles: torch's name, and SGLang's patched one (a sender that imported SGLang)
    CUDA_REBUILD = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}

    def find_class(self, module: str, name: str):  # noqa: D102
        if (module, name) in self.CUDA_REBUILD:
            return _rebuild_cuda_tensor
        if (module, name) == SGLANG_METADATA:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a serialized tensor "
                                     "payload (only torch tensor handles are accepted)")


def deserialize(payload: str | bytes) -> object:
    """The object of one ``serialized_named_tensors`` entry (base64 string or raw bytes)."""
    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    return _Unpickler(io.BytesIO(data)).load()


def bucket_tensors(obj: object) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor view) of a deserialized flattened bucket, as SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors``; ValueError names what is malformed."""
    if not (isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), list)):
        raise ValueError("a flattened_bucket entry must be {'flattened_tensor': uint8 tensor, "
                         "'metadata': [FlattenedTensorMetadata, ...]}")
    flat, out = obj["flattened_tensor"], []
    for meta in obj["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise ValueError(f"metadata entry {meta!r} is not a FlattenedTensorMetadata")
        if meta.end_idx > flat.numel() or meta.start_idx % meta.dtype.itemsize:
            raise ValueError(f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) do not lie "
                             f"aligned in the {flat.numel()}-byte flattened tensor")
        out.append((meta.name, flat[meta.start_idx:meta.end_idx].view(meta.dtype)
                    .reshape(meta.shape)))
    return out
