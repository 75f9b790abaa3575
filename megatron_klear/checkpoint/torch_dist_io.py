"""Megatron ``torch_dist`` checkpoints written and read tensor by tensor, no model in memory.

The converters never materialise a model. A Qwen3 GPTModel built on the *meta* device
gives megatron-core's own ``sharded_state_dict`` (checkpoint keys, layer offsets, the
gate/up chunks of ``linear_fc1``); :func:`param_slots` joins it with the
:data:`~megatron_klear.checkpoint.hf_bridge.RULES` walk, so the HF <-> Megatron mapping
stays the one table in ``hf_bridge``.

* Writing: :class:`StreamingSaveStrategy` is megatron's ``torch_dist`` save strategy that
  writes torch.distributed.checkpoint's files itself, from megatron's ShardedTensors: each
  chunk is one torch.save record (torch writes the frame around the data, see
  :func:`_record_frame`) whose data is written from its pieces, views of the mapped HF
  inputs (q/k/v as each query group's rows), as kernel copies; then the pickled
  ``.metadata``. No tensor is materialised unless ``--dtype`` casts it. Work is split
  over ranks by assigning each chunk's main replica to one rank (balanced by bytes); each
  rank writes its own files, ``threads`` of them concurrently. Records carry no CRC32
  (torch's own option, which ``torch.load`` accepts).
* Reading: :class:`TorchDistReader` reads the full (TP-merged) tensor of one checkpoint
  key and layer from a checkpoint saved at any TP/PP layout;
  :meth:`~TorchDistReader.read_parts` gives it as views of the files' pages where the
  saved chunks cover whole rows (the converter's own TP1 layout, column-parallel TP
  splits), so Megatron -> HF copies bytes from the page cache without loading them.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.overrides import TorchFunctionMode

from megatron_klear import platform
from megatron_klear.checkpoint import hf_bridge
from megatron_klear.checkpoint.hf_io import FileMaps, buffer_address, bytes_of, write_at
from megatron_klear.data.packing import balance
from megatron_klear.models import qwen3

__all__ = ["Chunk", "ParamSlot", "meta_model", "param_slots", "StreamingSaveStrategy",
           "TorchDistReader"]


@dataclass(frozen=True)
class Chunk:
    """One ShardedTensor of a parameter: its checkpoint key and global offset, and where it
    sits inside the parameter (shape, stride, storage offset of a view of it)."""

    key: str
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ParamSlot:
    """A Megatron parameter (TP1/PP1 layout), its mapping rule, HF names and chunks."""

    name: str
    rule: hf_bridge.Rule
    hf: list[str]
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)
    prepend: int = 0  # leading checkpoint axes (the layer index) before the parameter's own

    @property
    def key(self) -> str:
        return self.chunks[0].key

    @property
    def prefix(self) -> tuple[int, ...]:
        """The offsets on the prepended axes (e.g. ``(layer,)``)."""
        return self.chunks[0].global_offset[:self.prepend]


class _AllOnMeta(TorchFunctionMode):
    """Every tensor made or moved inside lands on the meta device, whatever device the
    caller names. ``with torch.device("meta")`` only fills in a *missing* device, and
    megatron's parallel layers and :mod:`~megatron_klear.models.norms` pass
    ``device=torch.cuda.current_device()``: under it a GPU would allocate the whole model."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or (func is torch.Tensor.to and args[0].is_meta):
            if func is torch.Tensor.to:  # keep a dtype change, drop the device
                dtype = kwargs.get("dtype") or next(
                    (a for a in args[1:] if isinstance(a, torch.dtype)), None)
                return args[0] if dtype is None else args[0].to(dtype)
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def meta_model(arch: qwen3.Qwen3Arch, dtype: torch.dtype) -> torch.nn.Module:
    """The Qwen3 GPTModel of the current parallel layout with every parameter and buffer on
    the meta device (no memory, on a GPU machine too)."""
    from megatron.core import parallel_state as ps

    config = qwen3.transformer_config(arch, tp=ps.get_tensor_model_parallel_world_size(),
                                      pp=ps.get_pipeline_model_parallel_world_size(),
                                      params_dtype=dtype, perform_initialization=False)
    with _AllOnMeta(), torch.device("meta"):
        return qwen3.build_gpt_model(arch, config).eval()


def param_slots(model: torch.nn.Module, arch: qwen3.Qwen3Arch) -> list[ParamSlot]:
    """Every parameter of ``model`` with its rule, HF names and checkpoint chunks."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    slots = []
    for name, param, rule, hf in hf_bridge.param_rules([model], arch):
        value = sharded[name]
        tensors = [v for v in (nested_values(value) if isinstance(value, (dict, list))
                               else [value]) if isinstance(v, ShardedTensor)]
        slot = ParamSlot(name, rule, hf, tuple(param.shape), prepend=tensors[0].prepend_axis_num)
        for st in tensors:
            slot.chunks.append(Chunk(st.key, tuple(st.global_offset), tuple(st.data.shape),
                                     tuple(st.data.stride()), st.data.storage_offset()))
        slots.append(slot)
    return slots


# ---------------------------------------------------------------- writing
_ALIGN = 64  # a record's data starts at a multiple of this in its file


def chunk_pieces(parts: list[torch.Tensor], c: Chunk, dtype: torch.dtype) -> list[torch.Tensor]:
    """The elements of chunk ``c`` of a parameter given as ``parts`` (concatenated on dim 0,
    see :func:`~megatron_klear.checkpoint.hf_bridge.split_parts_for_rank`), in ``dtype``,
    as contiguous flat tensors: views of the parts unless a cast or a strided part needs
    a copy."""
    contiguous = math.prod(c.shape) <= 1 or c.stride == _contiguous_strides(c.shape)
    if not contiguous:
        raise ValueError(f"checkpoint chunk {c.key} at {c.global_offset} is not a contiguous "
                         "range of its parameter (the converters write the TP1 layout)")
    pieces = hf_bridge.concat_rows([p.reshape(-1) for p in parts], c.storage_offset,
                                   c.storage_offset + c.numel)
    return [p.to(dtype).contiguous() for p in pieces]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.insert(0, n)
        n *= d
    return tuple(strides)


@functools.lru_cache(maxsize=None)
def _record_frame(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes]:
    """torch.save's bytes of a tensor of ``shape`` and ``dtype`` before and after its data:
    torch writes the format (zip of the pickle, the 64-byte aligned data record, version),
    the caller the data, from its sources. The stand-in tensor given to torch.save is never
    read (the records carry no CRC32, see :func:`_no_crc32`), so it takes no memory; one
    frame serves every tensor of that shape and dtype."""
    stand_in = torch.empty(shape, dtype=dtype)
    out = _FrameCapture(stand_in)
    with _no_crc32():
        torch.save(stand_in, out)
    return out.frame()


class _FrameCapture:
    """The write-only stream :func:`_record_frame` saves into: keeps the bytes written
    before and after the one write of the stand-in tensor's data, drops that."""

    def __init__(self, stand_in: torch.Tensor) -> None:
        self._data = (stand_in.data_ptr(), stand_in.nbytes)
        self._parts = [bytearray()]

    def write(self, data) -> int:  # noqa: D102
        buf = memoryview(data).cast("B")
        is_data = buf.nbytes and (buffer_address(buf), buf.nbytes) == self._data
        if len(self._parts) == 1 and is_data:
            self._parts.append(bytearray())
        else:
            self._parts[-1] += buf
        return buf.nbytes

    def flush(self) -> None:  # noqa: D102
        pass

    def frame(self) -> tuple[bytes, bytes]:
        if len(self._parts) != 2:
            raise RuntimeError("torch.save did not write the tensor's data in one piece")
        return bytes(self._parts[0]), bytes(self._parts[1])


class _RecordFile:
    """One ``.distcp`` file of torch.save records, one after the other: a tensor's data is
    written from its pieces (:func:`~megatron_klear.checkpoint.hf_io.write_at`: bytes of
    ``maps``' files are kernel copies) and starts :data:`_ALIGN`-byte aligned."""

    def __init__(self, path: Path, maps: FileMaps | None) -> None:
        self.name = path.name
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._maps, self._end = maps, 0

    def tensor(self, shape: tuple[int, ...], pieces: list[torch.Tensor]) -> tuple[int, int]:
        """Write a record of a tensor of ``shape`` whose data is the concatenation of the
        contiguous ``pieces``; return its (offset, length)."""
        head, tail = _record_frame(shape, pieces[0].dtype)
        start = self._end + (-self._end - len(head)) % _ALIGN
        pos = start + len(head)
        os.pwrite(self._fd, head, start)
        for b in map(bytes_of, pieces):
            write_at(self._fd, pos, b, self._maps)
            pos += len(b)
        os.pwrite(self._fd, tail, pos)
        self._end = pos + len(tail)
        return start, self._end - start

    def bytes(self, data: bytes) -> tuple[int, int]:
        """Append a bytes record; return its (offset, length)."""
        start = self._end
        os.pwrite(self._fd, data, start)
        self._end += len(data)
        return start, len(data)

    def close(self) -> None:
        """fsync and close."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


@dataclass
class _Written:
    """One record as the checkpoint's ``.metadata`` lists it (``chunk`` None: bytes)."""

    key: str
    storage: object  # torch's _StorageInfo
    chunk: object = None  # torch's ChunkStorageMetadata
    size: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


def _metadata(written: list[_Written], checkpoint_dir: Path):
    """torch.distributed.checkpoint's ``Metadata`` of these records (every rank's)."""
    import uuid

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    state, storage = {}, {}
    for w in written:
        if w.chunk is None:
            state[w.key] = BytesStorageMetadata()
        else:
            state.setdefault(w.key, TensorStorageMetadata(TensorProperties(dtype=w.dtype),
                                                          torch.Size(w.size), [])
                             ).chunks.append(w.chunk)
        storage[MetadataIndex(w.key, w.chunk.offsets if w.chunk is not None else None)] = \
            w.storage
    return Metadata(state, storage_data=storage, version=CURRENT_DCP_VERSION,
                    storage_meta=StorageMeta(checkpoint_dir, str(uuid.uuid4())))


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """``torch_dist`` save of a meta-device model whose tensors come from ``build(slot)``
    (the parameter as parts, views of the inputs where the layout allows, see
    :func:`chunk_pieces`), written record by record without materialising a state dict.

    The files are torch.distributed.checkpoint's (``__<rank>_<thread>.distcp`` records of
    torch.save, a pickled ``.metadata``), read by megatron's own loader. Each chunk's main
    replica goes to one rank (:func:`~megatron_klear.data.packing.balance`), so ``torchrun`` with N ranks splits the
    writing N ways; every rank writes ``threads`` files concurrently. ``release`` drops
    the memory of input pages a written tensor touched; bytes of ``maps``' files are
    copied into the checkpoint by the kernel.
    """

    def __init__(self, slots: list[ParamSlot],
                 build: Callable[[ParamSlot], list[torch.Tensor]], threads: int = 1,
                 release: Callable[[], None] = lambda: None,
                 maps: FileMaps | None = None) -> None:
        super().__init__("torch_dist", 1, thread_count=threads)
        self._where = {(c.key, c.global_offset): (s, c) for s in slots for c in s.chunks}
        self._build, self._release, self._maps = build, release, maps

    def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:  # noqa: D102
        import torch.distributed as dist
        from megatron.core.dist_checkpointing.strategies.torch import (
            _replace_state_dict_keys_with_sharded_keys)

        self._assign_replicas(sharded_state_dict)
        mine, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                keep_only_main_replica=True)
        items = [(key, v) for key, values in mine.items() for v in values]
        owner = balance([_nbytes_of(v) for _, v in items], self.thread_count)
        buckets = [[it for it, o in zip(items, owner) if o == t] for t in range(self.thread_count)]
        rank = dist.get_rank()
        with platform.host_only_section(), ThreadPoolExecutor(self.thread_count) as pool:
            written = [w for ws in pool.map(
                lambda t: self._write_file(Path(checkpoint_dir) / f"__{rank}_{t}.distcp",
                                           buckets[t]), range(self.thread_count)) for w in ws]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, written)
        if rank == 0:
            tmp = Path(checkpoint_dir) / ".metadata.tmp"
            tmp.write_bytes(pickle.dumps(_metadata([w for ws in every for w in ws],
                                                   Path(checkpoint_dir))))
            os.replace(tmp, Path(checkpoint_dir) / ".metadata")

    def _assign_replicas(self, sharded_state_dict) -> None:
        """Make one rank's copy of each chunk the main replica (balanced by bytes)."""
        import torch.distributed as dist
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        chunks = list(self._where)
        owner = dict(zip(chunks, balance([self._where[c][1].numel for c in chunks],
                                         dist.get_world_size())))
        for st in nested_values(sharded_state_dict):
            if isinstance(st, ShardedTensor) and (st.key, tuple(st.global_offset)) in owner:
                mine = owner[st.key, tuple(st.global_offset)] == dist.get_rank()
                st.replica_id = 0 if mine else 1

    def _write_file(self, path: Path, items: list) -> list[_Written]:
        """Write ``items`` ((sharded key, ShardedTensor | ShardedObject)) as one file."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        out, written = _RecordFile(path, self._maps), []
        try:
            for key, v in items:
                if isinstance(v, ShardedTensor):
                    shape = (1,) * v.prepend_axis_num + tuple(v.local_shape)
                    offset, length = out.tensor(shape, self._pieces(v))
                    self._release()
                    chunk = ChunkStorageMetadata(torch.Size(v.global_offset), torch.Size(shape))
                    written.append(_Written(key, _StorageInfo(out.name, offset, length), chunk,
                                            tuple(v.global_shape), v.dtype))
                else:  # a ShardedObject, serialised as megatron's mcore_to_pyt_state_dict does
                    data = io.BytesIO()
                    torch.save([v.data], data)
                    offset, length = out.bytes(data.getvalue())
                    written.append(_Written(key, _StorageInfo(out.name, offset, length)))
        finally:
            out.close()
        return written

    def _pieces(self, st) -> list[torch.Tensor]:
        if st.flattened_range is not None or (st.key, tuple(st.global_offset)) not in self._where:
            raise ValueError(f"{st.key} at {tuple(st.global_offset)}: not a parameter chunk "
                             "of the converted model")
        slot, c = self._where[(st.key, tuple(st.global_offset))]
        return chunk_pieces(self._build(slot), c, st.dtype)


def _nbytes_of(v) -> int:
    """Bytes a ShardedTensor's chunk takes (0 for other items: they are tiny)."""
    data = getattr(v, "data", None)
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else 0


@contextmanager
def _no_crc32():
    """torch.save without per-record CRC32 (torch.serialization's option; loads are
    unaffected): the checksum pass cost as much CPU as writing the bytes."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


# ---------------------------------------------------------------- reading
def _load_planner(target: torch.Tensor):
    """A torch.distributed.checkpoint LoadPlanner that copies every read into ``target``."""
    from torch.distributed.checkpoint.planner import LoadPlanner

    class _Into(LoadPlanner):
        def set_up_planner(self, *args, **kwargs):  # noqa: D102
            pass

        def create_local_plan(self):  # noqa: D102
            raise NotImplementedError

        def create_global_plan(self, global_plan):  # noqa: D102
            return global_plan

        def finish_plan(self, central_plan):  # noqa: D102
            return central_plan

        def load_bytes(self, read_item, value):  # noqa: D102
            raise NotImplementedError("tensor reads only")

        def resolve_tensor(self, read_item):  # noqa: D102
            view = target
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(dim, start, length)
            return view

        def commit_tensor(self, read_item, tensor):  # noqa: D102
            pass

    return _Into()


class TorchDistReader:
    """Full tensors of a ``torch_dist`` checkpoint, one key (and layer) at a time."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self._reader = FileSystemReader(str(checkpoint_dir))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._maps = FileMaps()

    def global_shape(self, key: str) -> tuple[int, ...]:
        """The saved global shape of ``key`` (e.g. the padded vocabulary of the save)."""
        return tuple(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        """The saved dtype of ``key``."""
        return self.metadata.state_dict_metadata[key].properties.dtype

    def _items(self, key: str, prefix: tuple[int, ...]):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.metadata.state_dict_metadata[key]
        own = tuple(md.size)[len(prefix):]
        chunk = ChunkStorageMetadata(offsets=torch.Size(prefix + (0,) * len(own)),
                                     sizes=torch.Size((1,) * len(prefix) + own))
        return md, own, chunk, create_read_items_for_chunk_list(key, md, [chunk])

    def read(self, key: str, prefix: tuple[int, ...] = ()) -> torch.Tensor:
        """``global[prefix]``: the whole tensor below the leading offsets ``prefix``,
        assembled from however many chunks the save wrote, in memory of its own.
        Thread-safe."""
        from torch.distributed.checkpoint.planner import LoadPlan

        md, own, chunk, items = self._items(key, prefix)
        target = torch.empty(chunk.sizes, dtype=md.properties.dtype)
        self._reader.read_data(LoadPlan(items), _load_planner(target)).wait()
        return target.reshape(own)

    def read_parts(self, key: str, prefix: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """``global[prefix]`` as tensors whose concatenation on dim 0 is it: views of the
        saved records' bytes in the files (see :meth:`release`) when the saved chunks
        split only that dim, else one tensor from :meth:`read`. Thread-safe."""
        md, own, _, items = self._items(key, prefix)
        parts = self._mapped_parts(items, len(prefix), own, md.properties.dtype)
        return parts if parts is not None else [self.read(key, prefix)]

    def release(self) -> None:
        """Drop the pages of the :meth:`read_parts` views from this process's memory (they
        stay in the page cache)."""
        self._maps.release()

    @property
    def maps(self) -> FileMaps:
        """The file maps behind :meth:`read_parts` (a writer copies their bytes file to
        file, see :meth:`~megatron_klear.checkpoint.hf_io.ShardWriter.write_bytes`)."""
        return self._maps

    def _mapped_parts(self, items, axis: int, own: tuple[int, ...],
                      dtype: torch.dtype) -> list[torch.Tensor] | None:
        if not own:
            return None
        rows = []
        for item in items:  # each read must be a whole saved chunk of whole rows
            if any(item.storage_offsets) or tuple(item.lengths)[axis + 1:] != own[1:] or any(
                    o for d, o in enumerate(item.dest_offsets) if d != axis):
                return None
            rows.append((item.dest_offsets[axis], item))
        parts, row = [], 0
        for start, item in sorted(rows, key=lambda r: r[0]):
            view = self._record_view(item, dtype) if start == row else None
            if view is None or tuple(view.shape) != tuple(item.lengths):
                return None
            parts.append(view.reshape(tuple(item.lengths)[axis:]))
            row += item.lengths[axis]
        return parts if row == own[0] else None

    def _record_view(self, item, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor torch.save wrote for one storage item, as a view of its file; None
        when it is not one contiguous tensor of ``dtype`` stored as is (e.g. a storage
        transform such as compression)."""
        info = self._reader.storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            return None
        path = self._reader.fs.concat_path(self._reader.path, info.relative_path)
        layout = _record_layout(path, info.offset, info.length)
        if layout is None or layout[1] != dtype:
            return None
        data_offset, _, shape = layout
        return self._maps.view(Path(path), info.offset + data_offset, dtype, shape)


def _record_layout(path, offset: int, length: int
                   ) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    """Where the data of the tensor torch.save wrote at ``[offset, offset + length)`` of
    ``path`` starts (relative to ``offset``), its dtype and shape; None unless it is one
    contiguous tensor that starts its storage and fills it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        archive = torch._C.PyTorchFileReader(
            io.BufferedReader(_FileWindow(fd, offset, length), buffer_size=1 << 16))
        try:
            storage, start, shape, stride = _TensorPickle(
                io.BytesIO(archive.get_record("data.pkl"))).load()
            _, storage_type, key, _, numel = storage
            dtype = storage_type.dtype
            data = archive.get_record_offset(f"data/{key}")
        except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError,
                EOFError):
            return None
    finally:
        os.close(fd)
    n = math.prod(shape)
    if start != 0 or n != numel or (n > 1 and tuple(stride) != _contiguous_strides(shape)):
        return None
    return data, dtype, tuple(shape)


class _TensorPickle(pickle.Unpickler):
    """Unpickles torch.save's ``data.pkl`` of one plain tensor into (storage id, storage
    offset, shape, stride) without touching its data; anything else is refused (the
    caller then loads the record with torch.load)."""

    def find_class(self, module: str, name: str):  # noqa: D102
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, start, shape, stride, *_: (storage, start, tuple(shape),
                                                              tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):  # noqa: D102
        return pid


class _FileWindow(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable raw stream (pread)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:  # noqa: D102
        return True

    def seekable(self) -> bool:  # noqa: D102
        return True

    def tell(self) -> int:  # noqa: D102
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:  # noqa: D102
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf) -> int:  # noqa: D102
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        self._pos += got
        return got
