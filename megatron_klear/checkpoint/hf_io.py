"""Hugging Face checkpoint files: read and write safetensors without holding a model.

The trainer (``train/engine.py``) and the converters (``checkpoint/convert.py``) both use
this module; it imports neither of them.

* :class:`SafetensorsReader` reads one tensor at a time with ``os.pread`` into a tensor
  that owns its memory, or (:meth:`~SafetensorsReader.mapped`, for the converters) gives a
  view of the file's pages that :meth:`~SafetensorsReader.release` drops again: writing
  from the page cache needs no copy in user space and no fresh memory.
* :class:`FileMaps` is that memory map with page dropping, shared with the ``torch_dist``
  reader; :func:`element_runs` and :func:`byte_slices` turn a strided view into the byte
  ranges a writer copies.
* :func:`plan_shards` + :class:`ShardWriter` write safetensors shards whose headers are
  known before any data exists: each tensor is written at its final offset as soon as it
  is produced, so writing holds one tensor, and shards can be written concurrently.
* :func:`export_model_to_hf` writes a live model (any TP/PP) as an HF directory.

Every directory is written under ``.<name>.tmp`` next to the target and renamed at the end.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import mmap
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["ConversionError", "SafetensorsReader", "ShardPlan", "ShardWriter", "plan_shards",
           "write_index", "copy_tokenizer_files", "tmp_dir", "publish_dir",
           "export_model_to_hf", "DTYPE_CODES", "checkpoint_dtype", "FileMaps", "element_runs",
           "byte_slices", "copy_range", "write_at", "start_writeback", "bytes_of",
           "buffer_address"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
DTYPE_CODES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {v: k for k, v in DTYPE_CODES.items()}
_MAX_IO = 1 << 30  # bytes per pread/pwrite call (Linux caps one call at ~2 GiB)


class ConversionError(ValueError):
    """Bad converter input; the message names the flag, file or tensor and the fix."""


# ---------------------------------------------------------------- directories
def tmp_dir(out_dir: Path) -> Path:
    """The temp dir a result is built in before :func:`publish_dir` renames it."""
    return out_dir.parent / f".{out_dir.name}.tmp"


def publish_dir(tmp: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the finished ``tmp`` (rename; the old one goes only after)."""
    old = out_dir.parent / f".{out_dir.name}.old"
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy everything of an HF dir except config.json and weight files (tokenizer etc.)."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, dst / f.name)


# ---------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated safetensors file (no header)")
        (size,) = struct.unpack("<Q", head)
        try:
            return {"__size__": size, **json.loads(f.read(size))}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{path}: corrupt safetensors header ({exc})") from exc


def bytes_of(t: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous tensor's bytes (unlike ``.numpy()`` this leaves its
    storage resizable, so a streaming writer can free it once written)."""
    if t.nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def buffer_address(buf) -> int:
    """The memory address of a (non-empty, contiguous) buffer's first byte, read-only
    buffers included."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + _MAX_IO]], offset + done)
        if n <= 0:
            raise ConversionError(f"unexpected end of file at byte {offset + done}")
        done += n


class SafetensorsReader:
    """The tensors of an HF model directory (any shard count), read one tensor at a time.

    Only headers are read up front. Each call returns a fresh tensor that owns its memory,
    read with ``os.pread`` (thread-safe; the GIL is released during the read);
    :meth:`mapped` returns a view of the file instead.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        hf_dir = Path(hf_dir)
        self.files = sorted(hf_dir.glob("*.safetensors"))
        if not self.files:
            raise ConversionError(f"--hf-dir {hf_dir}: no *.safetensors files (only safetensors "
                                  "checkpoints are supported; re-save with safe_serialization)")
        self._entries: dict[str, _Entry] = {}
        self._maps = FileMaps()
        for f in self.files:
            header = _read_header(f)
            base = 8 + header.pop("__size__")
            header.pop("__metadata__", None)
            for name, info in header.items():
                if info["dtype"] not in DTYPE_CODES:
                    raise ConversionError(f"{f}: tensor {name!r} has unsupported dtype "
                                          f"{info['dtype']}")
                start, end = info["data_offsets"]
                self._entries[name] = _Entry(f, DTYPE_CODES[info["dtype"]], tuple(info["shape"]),
                                             base + start, end - start)

    def names(self) -> list[str]:
        """All tensor names across shards (file order)."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its shard header."""
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's dtype from its shard header."""
        return self._entries[name].dtype

    def __call__(self, name: str) -> torch.Tensor:
        """One tensor by name, in a fresh buffer; ``KeyError`` for an unknown name."""
        e = self._entries[name]
        out = torch.empty(e.nbytes, dtype=torch.uint8)
        fd = os.open(e.file, os.O_RDONLY)
        try:
            _pread_into(fd, bytes_of(out), e.offset)
        finally:
            os.close(fd)
        return out.view(e.dtype).reshape(e.shape)

    def mapped(self, name: str) -> torch.Tensor:
        """One tensor by name as a view of its shard's pages (copy-on-write private map:
        nothing is read until used, the file never changes). Its pages count as this
        process's memory until :meth:`release`. Thread-safe."""
        e = self._entries[name]
        return self._maps.view(e.file, e.offset, e.dtype, e.shape)

    @property
    def maps(self) -> FileMaps:
        """The file maps behind :meth:`mapped` (for writers that copy file to file)."""
        return self._maps

    def release(self) -> None:
        """Drop the pages of the :meth:`mapped` tensors from this process's memory (they
        stay in the page cache; a later access reads them in again)."""
        self._maps.release()


class FileMaps:
    """Files mapped once each (private, copy-on-write, read-only use), handing out tensor
    views of byte ranges; :meth:`release` drops every mapped page from this process
    (``madvise(MADV_DONTNEED)``; they stay in the page cache and a view in use reads them
    in again), so resident memory stays at what is used between releases. Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._spans: list[tuple[int, int, int]] = []  # (address, length, fd) of each map
        self._lock = threading.Lock()

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(path)
            if m is None:
                fd = os.open(path, os.O_RDONLY)  # kept open for locate()'s kernel copies
                m = self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                self._spans.append((ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m), fd))
            return m

    def locate(self, buf) -> tuple[int, int] | None:
        """(open file descriptor, file offset) of the bytes of ``buf`` (any contiguous
        buffer, read-only ones included) when they lie in one of the maps, so a writer can
        have the kernel copy them file to file; None for other memory."""
        if not len(buf):
            return None
        address = buffer_address(buf)
        for start, length, fd in self._spans:
            if start <= address and address + len(buf) <= start + length:
                return fd, address - start
        return None

    def view(self, path: Path, offset: int, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at ``offset`` of ``path`` as a tensor of ``dtype`` and ``shape``."""
        nbytes = _nbytes(dtype, shape)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        m = self._map(Path(path))
        if offset + nbytes > len(m):
            raise ConversionError(f"{path}: truncated (a tensor ends at byte "
                                  f"{offset + nbytes}, the file at {len(m)})")
        return torch.frombuffer(m, dtype=dtype, count=nbytes // dtype.itemsize,
                                offset=offset).view(shape)

    def release(self) -> None:
        """Drop every mapped page from this process (see the class docstring)."""
        with self._lock:
            maps = list(self._maps.values())
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> int:
    """Kernel file-to-file copy (``copy_file_range``, positional: neither file's offset
    moves); returns the bytes copied, short where the kernel or file system cannot (e.g.
    across file systems): the caller writes the rest."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, min(nbytes - done, _MAX_IO), src_offset + done,
                                   dst_offset + done)
            if n <= 0:
                break
            done += n
    except OSError:
        pass
    return done


def write_at(fd: int, pos: int, buf: memoryview, maps: FileMaps | None = None) -> None:
    """Write the bytes ``buf`` at ``pos`` of ``fd``; when they are a view of one of ``maps``'
    files the kernel copies them file to file (:func:`copy_range`), the rest is written.
    A large write then starts the file's write-back (:func:`start_writeback`)."""
    where = maps.locate(buf) if maps is not None else None
    done = copy_range(*where, fd, pos, len(buf)) if where is not None else 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:done + _MAX_IO], pos + done)
    if len(buf) >= _WRITEBACK_MIN:
        start_writeback(fd)


_WRITEBACK_MIN = 1 << 20  # smaller writes are left to the next large one or the fsync
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; None elsewhere: write-back then waits for fsync)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int) -> None:
    """Have the kernel start writing ``fd``'s dirty pages to disk now, without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` over the whole file). The writers call it
    after each large write, so the disk writes while the next tensor is produced and the
    closing fsync finds the data written: with the system's default dirty-page limits
    (gigabytes) nothing is written back before the fsync otherwise, and a conversion then
    waited ~0.4 s per GB in it. Durability still comes from the fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def element_runs(view: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, count) runs of storage elements that ``view`` covers, in its row-major
    order: one run for a contiguous view, one per leading index for e.g. a block of rows
    per q/k/v group. Works on meta tensors (strides and offsets only)."""
    shape, stride = list(view.shape), list(view.stride())
    inner = 1  # elements per run: the longest contiguous suffix of dims
    while shape and (shape[-1] == 1 or stride[-1] == inner):
        inner *= shape.pop()
        stride.pop()
    starts = [view.storage_offset()]
    for size, step in zip(shape, stride):
        starts = [s + i * step for s in starts for i in range(size)]
    runs: list[tuple[int, int]] = []
    for s in starts:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + inner)
        else:
            runs.append((s, inner))
    return runs if inner else []


def byte_slices(parts: list[torch.Tensor], runs: list[tuple[int, int]]) -> list[memoryview]:
    """The bytes of element ``runs`` of the concatenation of contiguous ``parts`` (one
    dtype), as memoryviews of the parts' memory: nothing is copied."""
    bufs = [bytes_of(p) for p in parts]
    itemsize = parts[0].element_size()
    ends, end = [], 0
    for b in bufs:
        end += len(b)
        ends.append(end)
    out = []
    for start, count in runs:
        lo, hi = start * itemsize, (start + count) * itemsize
        for k, b in enumerate(bufs):
            base = ends[k] - len(b)
            if lo < ends[k] and hi > base:
                out.append(b[max(lo, base) - base:min(hi, ends[k]) - base])
    return out


def checkpoint_dtype(hf_config: dict, reader: SafetensorsReader) -> torch.dtype:
    """The dtype an HF checkpoint was saved in: config ``torch_dtype``/``dtype``, else the
    dtype of its floating-point tensors."""
    for key in ("torch_dtype", "dtype"):
        value = hf_config.get(key)
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    floats = {reader.dtype(n) for n in reader.names() if reader.dtype(n).is_floating_point}
    if len(floats) != 1:
        raise ConversionError("--dtype auto: config.json names no torch_dtype and the tensors "
                              f"have dtypes {sorted(map(str, floats))}; pass --dtype explicitly")
    return floats.pop()


# ---------------------------------------------------------------- writing
@dataclass
class ShardPlan:
    """One output safetensors file: its name and (tensor name, dtype, shape) in order."""

    file: str
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(d, s) for _, d, s in self.tensors)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_shards(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                max_shard_bytes: int) -> list[ShardPlan]:
    """Split (name, dtype, shape) into consecutive shards of at most ``max_shard_bytes``
    (a bigger tensor gets a shard of its own), named ``model-0000k-of-0000n.safetensors``."""
    groups: list[list] = [[]]
    size = 0
    for name, dtype, shape in tensors:
        nbytes = _nbytes(dtype, shape)
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, tuple(shape)))
        size += nbytes
    return [ShardPlan(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", g)
            for k, g in enumerate(groups)]


class ShardWriter:
    """Write one planned safetensors shard: the header first, each tensor at its offset.

    :meth:`write` may be called in any order; :meth:`close` checks that every planned tensor
    was written, fsyncs and closes.
    """

    def __init__(self, path: Path, plan: ShardPlan) -> None:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self._where: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        for name, dtype, shape in plan.tensors:
            nbytes = _nbytes(dtype, shape)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._where[name] = (offset, dtype, shape)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._base = 8 + len(raw)
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        self._pending = set(self._where)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (dtype and shape as planned) at its place in the file."""
        offset, dtype, shape = self._where[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: planned {dtype} {shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        data = tensor.contiguous()  # held while its bytes are written (a view holds nothing)
        self.write_bytes(name, [bytes_of(data)])

    def write_bytes(self, name: str, bufs: list[memoryview],
                    maps: FileMaps | None = None) -> None:
        """Write the concatenation of ``bufs`` as tensor ``name`` (its planned byte size).
        Bytes that are views of ``maps``' files are copied file to file by the kernel
        (``copy_file_range``: no page of them enters this process)."""
        offset, dtype, shape = self._where[name]
        if sum(len(b) for b in bufs) != _nbytes(dtype, shape):
            raise ValueError(f"{name}: planned {_nbytes(dtype, shape)} bytes, got "
                             f"{sum(len(b) for b in bufs)}")
        pos = self._base + offset
        for b in bufs:
            write_at(self._fd, pos, b, maps)
            pos += len(b)
        self._pending.discard(name)

    def close(self) -> None:
        """fsync and close; raise if a planned tensor was never written."""
        try:
            if self._pending:
                raise ValueError(f"{self._path}: tensors never written: {sorted(self._pending)[:3]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


def write_index(out: Path, plans: list[ShardPlan]) -> None:
    """``model.safetensors.index.json`` for the planned shards."""
    weight_map = {name: p.file for p in plans for name, _, _ in p.tensors}
    index = {"metadata": {"total_size": sum(p.nbytes for p in plans)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------- live model export
def export_model_to_hf(model_chunks: list[torch.nn.Module], arch, out_dir: str | Path, *,
                       tokenizer_dir: str | Path | None = None) -> Path:
    """Write a live model (any TP/PP, called by every rank) as a Hugging Face checkpoint.

    Each pipeline stage writes its own safetensors shard (from its TP rank 0 of DP rank 0);
    rank 0 writes the index, config.json and tokenizer files, then publishes atomically.
    ``arch`` is the model's :class:`~megatron_klear.models.qwen3.Qwen3Arch`.
    """
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint import hf_bridge

    out_dir = Path(out_dir)
    tmp = tmp_dir(out_dir)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    fname = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    tensors = hf_bridge.export_hf_weights(model_chunks, arch, copy=False)
    plan = None
    if writer:  # every TP rank iterates the (collective) export; one writes
        held = [(n, t.contiguous()) for n, t in tensors]
        plan = ShardPlan(fname, [(n, t.dtype, tuple(t.shape)) for n, t in held])
        shard = ShardWriter(tmp / fname, plan)
        for n, t in held:
            shard.write(n, t)
        shard.close()
    else:
        for _ in tensors:
            pass
    listing: list = [None] * dist.get_world_size()
    dist.all_gather_object(listing, plan)
    if rank == 0:
        write_index(tmp, [p for p in listing if p is not None])
        if tokenizer_dir is not None:
            copy_tokenizer_files(Path(tokenizer_dir), tmp)
        (tmp / "config.json").write_text(json.dumps(arch.hf_config, indent=2))
        publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir
