"""Trainer offload for colocated mode: parameters, gradients and optimizer state to host
memory while the rollout engines use the GPU, and back for the training step.

What moves is every storage that holds them, found again at every offload from the model
chunks and the optimizer as they are then (an optimizer may create its state inside
``step()``: Transformer Engine's FusedAdam, megatron's pick when TE is installed, makes its
Adam moments lazily at the first step, so storages found before it would miss them): megatron DDP's ``param_data``/``grad_data`` buffers (every parameter and
``main_grad`` is a view of one), the optimizer's main parameters (the distributed
optimizer's fp32 shards included) and their gradients, and every tensor of the optimizer
state (Adam's moments, step counters). A storage is copied whole into its slice of the
group's host arena and then resized to zero bytes, which frees the device memory while every
tensor that views it -- parameters, DDP buckets, optimizer shards -- stays a valid object;
:meth:`TrainerOffload.onload` resizes it back and copies the bytes in. The bytes come back
as they left, so training with offload is bitwise equal to training without it
(tests/multiprocess/test_offload.py). This is the technique of slime's and verl's colocated trainers
(``storage().resize_(0)``); not run on a GPU, where the freed blocks also go back to the
driver (``torch.cuda.empty_cache``) for the engines to allocate.

The host arena of a group is one buffer pinned exactly (``platform.pinned_buffer``: a
registered plain allocation), made at the group's first offload and reused by every later one
(a larger one replaces it when the group grew, e.g. by an optimizer's lazy state): pinning
one buffer per storage through torch's caching host allocator rounded each up to a power of
two and kept it, up to twice the trainer's state per rank (issue 51). The dry run plans these
bytes per node (train/memory.py ``plan_host``).

Storages already in host memory while training computes on a GPU (``--optimizer-cpu-offload``
keeps the optimizer state there) stay where they are.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from megatron_klear import platform

__all__ = ["TrainerOffload", "trainer_tensors"]


def _leaf_optimizers(optimizer) -> Iterator:
    """The megatron optimizers of ``optimizer`` (a ChainedOptimizer holds several, for MoE)."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        yield opt


def trainer_tensors(model_chunks: Iterable[torch.nn.Module], optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of the trainer's state: parameters and their ``main_grad``, DDP's
    param/grad buffers, and per optimizer its (main) parameters, their grads and its state."""
    for chunk in model_chunks:
        for p in chunk.parameters():
            yield p
            if getattr(p, "main_grad", None) is not None:
                yield p.main_grad
        for name in ("buffers", "expert_parallel_buffers"):  # megatron DDP's bucket buffers
            bufs = getattr(chunk, name, None)  # (a bare module's ``buffers`` is a method)
            for buf in bufs if isinstance(bufs, list) else ():
                yield from (t for t in (buf.param_data, buf.grad_data) if t is not None)
    if optimizer is None:
        return
    for opt in _leaf_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


GROUPS = ("params", "state")  # parameter storages (DDP's param_data); everything else


class TrainerOffload:
    """Offload and onload of the trainer's storages (no collectives; every rank its own), in
    two groups that may leave separately: ``params`` (what the parameters view: the weights
    a sync reads) and ``state`` (gradients, main parameters, optimizer state)."""

    def __init__(self, model_chunks: list[torch.nn.Module], optimizer) -> None:
        self.device = platform.device()
        self.model_chunks, self.optimizer = model_chunks, optimizer
        self.storages: dict[str, list[torch.UntypedStorage]] = {g: [] for g in GROUPS}
        self._views: dict[int, torch.Tensor] = {}  # per storage: a tensor viewing it
        self._host: dict[str, list[torch.Tensor]] = {}  # per offloaded group
        self._arenas: dict[str, torch.Tensor] = {}  # per group: its pinned host arena
        self._scan()

    def _scan(self) -> None:
        """Find the device storages of every group still on the device, as the trainer's
        state is now (the optimizer's state included, however late it was made)."""
        params = {p.untyped_storage()._cdata for c in self.model_chunks for p in c.parameters()}
        views = {s._cdata: self._views[s._cdata] for g in self._host for s in self.storages[g]}
        found: dict[str, list[torch.UntypedStorage]] = {g: [] for g in GROUPS}
        for t in trainer_tensors(self.model_chunks, self.optimizer):
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: one per storage, whatever views it
            if key in views or storage.nbytes() == 0 or t.device.type != self.device.type:
                continue
            found["params" if key in params else "state"].append(storage)
            views[key] = t.detach()
        self._views = views  # no view keeps a storage the trainer dropped alive
        for g in GROUPS:
            if g not in self._host:
                self.storages[g] = found[g]

    @property
    def nbytes(self) -> int:
        """Bytes of trainer state this moves."""
        return sum(h.numel() for hs in self._host.values() for h in hs) + sum(
            s.nbytes() for g, ss in self.storages.items() if g not in self._host for s in ss)

    @property
    def offloaded(self) -> bool:
        """True while any group is offloaded."""
        return bool(self._host)

    def offload(self, group: str | None = None, *, unchanged: bool = False) -> float:
        """Copy the storages of ``group`` (default: every group still on the device) to host
        memory and free them on the device; seconds taken. ``unchanged``: they hold the bytes
        the last onload brought (a frozen model's weights), so only free them."""
        groups = [group] if group else [g for g in GROUPS if g not in self._host]
        if any(g not in GROUPS or g in self._host for g in groups):
            raise RuntimeError(f"offload({group!r}): expected one of {GROUPS} still on the "
                               f"device (offloaded now: {sorted(self._host)})")
        start = time.perf_counter()
        self._scan()
        for g in groups:
            if unchanged and g not in self._arenas:
                raise RuntimeError(f"offload({g!r}, unchanged=True): never offloaded before, "
                                   "so the host holds no copy")
            host = self._slices(g)
            for storage, h in zip(self.storages[g], host):
                if not unchanged:
                    h.copy_(self._bytes(storage))
            for storage in self.storages[g]:
                storage.resize_(0)
            self._host[g] = host
        torch.cuda.empty_cache()  # give the blocks back for the engines (no-op without CUDA)
        return time.perf_counter() - start

    def onload(self) -> float:
        """Allocate every offloaded storage on the device again and copy its bytes back;
        seconds taken."""
        if not self._host:
            raise RuntimeError("the trainer state is not offloaded; offload() first")
        start = time.perf_counter()
        for g, host in self._host.items():
            for storage, h in zip(self.storages[g], host):
                storage.resize_(h.numel())
                self._bytes(storage).copy_(h)
        self._host = {}
        return time.perf_counter() - start

    def _slices(self, group: str) -> list[torch.Tensor]:
        """One slice of the group's pinned arena per storage (each at a 64-byte boundary);
        the arena is made, or replaced by a larger one, when the storages outgrow it."""
        offsets, end = [], 0
        for storage in self.storages[group]:
            offsets.append(end)
            end += -(-storage.nbytes() // 64) * 64
        arena = self._arenas.get(group)
        if arena is None or arena.numel() < end:
            self._arenas.pop(group, None)
            arena = self._arenas[group] = platform.pinned_buffer(end)
        return [arena[o:o + s.nbytes()] for o, s in zip(offsets, self.storages[group])]

    def _bytes(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """A uint8 tensor over the whole of ``storage``, made from a tensor that views it (a
        view of a device tensor is one on every platform; ``Tensor.set_`` from a new empty
        tensor would lose the device in the strict virtual-CUDA mode, which tags storages by
        the ops that make them)."""
        t = self._views[storage._cdata]
        first = torch.as_strided(t, (1,), (1,), 0).view(torch.uint8)  # byte 0 of the storage
        return torch.as_strided(first, (storage.nbytes(),), (1,), 0)
