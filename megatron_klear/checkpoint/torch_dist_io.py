"""Megatron ``torch_dist`` checkpoints written and read tensor by tensor, no model in memory.

The converters never materialise a model. A Qwen3 GPTModel built on the *meta* device
gives megatron-core's own ``sharded_state_dict`` (checkpoint keys, layer offsets, the
gate/up chunks of ``linear_fc1``); :func:`param_slots` joins it with the
:data:`~megatron_klear.checkpoint.hf_bridge.RULES` walk, so the HF <-> Megatron mapping
stays the one table in ``hf_bridge``.

* Writing: :class:`StreamingSaveStrategy` is megatron's ``torch_dist`` save strategy whose
  tensors are produced only when torch.distributed.checkpoint writes them (one tensor per
  writer thread in memory). Work is split over ranks by assigning each chunk's main
  replica to one rank (balanced by bytes); each rank writes its own files, with
  ``threads`` files written concurrently per rank.
  torch.save records are written without their CRC32 (torch's own option, which
  ``torch.load`` accepts): computing it was a full extra pass over the bytes.
* Reading: :class:`TorchDistReader` reads the full (TP-merged) tensor of one checkpoint
  key and layer from a checkpoint saved at any TP/PP layout;
  :meth:`~TorchDistReader.read_parts` gives it as views of the files' pages where the
  saved chunks cover whole rows (the converter's own TP1 layout, column-parallel TP
  splits), so Megatron -> HF copies bytes from the page cache without loading them.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint.filesystem import FileSystem
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                               TorchDistSaveShardedStrategy)

from megatron_klear import platform
from megatron_klear.checkpoint import hf_bridge
from megatron_klear.checkpoint.hf_io import FileMaps, write_at
from megatron_klear.models import qwen3

__all__ = ["Chunk", "ParamSlot", "meta_model", "param_slots", "StreamingSaveStrategy",
           "TorchDistReader", "balance"]


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


def meta_model(arch: qwen3.Qwen3Arch, dtype: torch.dtype) -> torch.nn.Module:
    """The Qwen3 GPTModel of the current parallel layout on the meta device (no memory)."""
    from megatron.core import parallel_state as ps

    config = qwen3.transformer_config(arch, tp=ps.get_tensor_model_parallel_world_size(),
                                      pp=ps.get_pipeline_model_parallel_world_size(),
                                      params_dtype=dtype, perform_initialization=False)
    with torch.device("meta"):
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


def balance(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each item: largest first onto the least loaded rank (deterministic)."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


# ---------------------------------------------------------------- writing
class _ChunkSource:
    """Produces each chunk's tensor when the writer asks for it, and frees it once written.

    ``build(slot)`` returns the parameter as parts whose concatenation on dim 0 is the
    parameter (:func:`~megatron_klear.checkpoint.hf_bridge.split_parts_for_rank`); a chunk
    that is exactly one part (gate or up of ``linear_fc1``) is that part, no copy. A
    parameter cut into several chunks is kept until its last chunk was taken.

    torch's FileSystemWriter keeps a reference to every tensor it wrote until its file is
    complete; the serial loader asks for a thread's next tensor only after writing the
    previous one, so :meth:`chunk` releases that thread's previous tensor's memory (the
    writer is built with ``per_thread_copy_ahead=0`` so that it always loads serially):
    an owned tensor's storage is freed, and ``release()`` drops the mapped input files'
    pages from the process (those of a view, or of the source of a converted copy).
    Thread-safe.
    """

    def __init__(self, slots: list[ParamSlot],
                 build: Callable[[ParamSlot], list[torch.Tensor]],
                 release: Callable[[], None] = lambda: None) -> None:
        self._where = {(c.key, c.global_offset): (s, c) for s in slots for c in s.chunks}
        self._build = build
        self._release = release
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[list[torch.Tensor], int]] = {}
        self._building: dict[str, threading.Event] = {}
        self._last = threading.local()

    def __contains__(self, index: tuple[str, tuple[int, ...]]) -> bool:
        return index in self._where

    def chunk(self, key: str, offset: tuple[int, ...]) -> torch.Tensor:
        """The chunk's tensor, owning exactly its storage (what the writer saves as is)."""
        previous = getattr(self._last, "tensor", None)
        if previous is not None:  # written by now: give its memory back
            if previous.untyped_storage().resizable():
                previous.untyped_storage().resize_(0)
            self._release()  # (also the pages a converted copy was read from)
        slot, c = self._where[(key, offset)]
        out = self._cut(self._parts(slot), slot, c)
        self._last.tensor = out
        return out

    @staticmethod
    def _cut(parts: list[torch.Tensor], slot: ParamSlot, c: Chunk) -> torch.Tensor:
        start = 0  # (shapes only: an earlier part may be written and freed already)
        for part in parts:  # a chunk that is one whole part: the part itself
            if part.shape == c.shape and start == c.storage_offset and _owns(part):
                return part
            start += math.prod(part.shape)
        full = parts[0] if len(parts) == 1 else torch.cat(parts)
        if full.shape == c.shape and _owns(full):
            return full
        return full.reshape(slot.shape).as_strided(c.shape, c.stride, c.storage_offset).clone()

    def _parts(self, slot: ParamSlot) -> list[torch.Tensor]:
        if len(slot.chunks) == 1:
            return self._build(slot)
        with self._lock:
            event = self._building.get(slot.name)
            owner = event is None and slot.name not in self._kept
            if owner:
                event = self._building[slot.name] = threading.Event()
        if owner:
            parts = self._build(slot)
            with self._lock:
                self._kept[slot.name] = (parts, len(slot.chunks))
                del self._building[slot.name]
            event.set()
        elif event is not None:
            event.wait()
        with self._lock:
            parts, left = self._kept[slot.name]
            if left == 1:
                del self._kept[slot.name]
            else:
                self._kept[slot.name] = (parts, left - 1)
        return parts


def _owns(t: torch.Tensor) -> bool:
    """Contiguous and the only user of exactly its whole storage."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes)


def _save_planner(source: _ChunkSource):
    """megatron's torch_dist save planner, producing tensors only when they are written."""
    from torch.distributed.checkpoint.planner import WriteItemType

    class _StreamingPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):  # noqa: D102 (torch's SavePlanner API)
            index = (write_item.index.fqn, tuple(write_item.index.offset or ()))
            if write_item.type != WriteItemType.BYTE_IO and index in source:
                # the saved chunk carries the prepended (layer) axes of the global tensor
                return source.chunk(*index).view(write_item.tensor_data.chunk.sizes)
            return super().resolve_data(write_item)

    return _StreamingPlanner(flatten_state_dict=False)


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """``torch_dist`` save of a meta-device model whose tensors come from ``build(slot)``
    (the parameter as parts, see :class:`_ChunkSource`).

    Each chunk's main replica goes to one rank (:func:`balance`), so ``torchrun`` with N
    ranks splits the writing N ways; every rank writes ``threads`` files concurrently.
    ``release`` drops the memory of written tensors that are views of a mapped file;
    bytes of ``maps``' files are copied into the checkpoint files by the kernel
    (:class:`_CopyingStream`).
    """

    def __init__(self, slots: list[ParamSlot],
                 build: Callable[[ParamSlot], list[torch.Tensor]], threads: int = 1,
                 release: Callable[[], None] = lambda: None,
                 maps: FileMaps | None = None) -> None:
        super().__init__("torch_dist", 1, thread_count=threads)
        self._slots = slots
        self._source = _ChunkSource(slots, build, release)
        self._maps = maps

    def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:  # noqa: D102
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.dist_checkpointing.strategies.torch import (
            _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

        chunks = [(c.key, c.global_offset) for s in self._slots for c in s.chunks]
        sizes = [c.numel for s in self._slots for c in s.chunks]
        owner = dict(zip(chunks, balance(sizes, dist.get_world_size())))
        me = dist.get_rank()
        for st in nested_values(sharded_state_dict):
            if isinstance(st, ShardedTensor) and (st.key, tuple(st.global_offset)) in owner:
                st.replica_id = 0 if owner[st.key, tuple(st.global_offset)] == me else 1
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        writer = dcp.FileSystemWriter(checkpoint_dir, single_file_per_rank=True,
                                      sync_files=True, thread_count=self.thread_count,
                                      per_thread_copy_ahead=0)
        if self._maps is not None:
            writer.fs = _CopyingFileSystem(self._maps)
        with _no_crc32(), platform.host_only_section():
            dcp.save(pyt_state_dict, storage_writer=writer, planner=_save_planner(self._source))


class _CopyingStream:
    """A binary output file whose writes of bytes that lie in mapped input files (a
    tensor's data, as torch.save hands it over) are kernel copies (``copy_file_range``):
    the bytes never pass through this process. Everything else goes to the file as is."""

    _MIN = 1 << 16  # smaller writes (zip headers, pickles) are not worth a lookup

    def __init__(self, f, maps: FileMaps) -> None:
        self._f, self._maps = f, maps

    def write(self, data) -> int:  # noqa: D102
        buf = memoryview(data).cast("B")
        if buf.nbytes < self._MIN:
            return self._f.write(buf)
        self._f.flush()
        pos = self._f.tell()
        write_at(self._f.fileno(), pos, buf, self._maps)
        self._f.seek(pos + buf.nbytes)
        return buf.nbytes

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


class _CopyingFileSystem(FileSystem):
    """torch's local FileSystem whose output streams are :class:`_CopyingStream` s."""

    def __init__(self, maps: FileMaps) -> None:
        super().__init__()
        self._maps = maps

    @contextmanager
    def create_stream(self, path, mode):  # noqa: D102 (torch's FileSystem API)
        with super().create_stream(path, mode) as f:
            yield _CopyingStream(f, self._maps) if "w" in mode else f


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
    contiguous, n = [], 1
    for d in reversed(shape):
        contiguous.insert(0, n)
        n *= d
    if start != 0 or n != numel or (n > 1 and list(stride) != contiguous):
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
