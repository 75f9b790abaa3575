"""Colocated weight sync: the trainer passes its weights to engines on its own GPUs by handle.

:class:`TensorWeightSync` is :class:`~megatron_klear.rollout.transport.weight_sync.WeightSync` with
another transport: the same export (``hf_bridge.export_views``: the one Megatron -> HF
mapping), the same bucket plan (``plan_bucket``/``aligned_order``: SGLang's flattened,
aligned layout), the same session (pause, flush, ``/begin_weight_update`` ...
``/end_weight_update``, resume; cleanup on failure), the same probe. What differs: there is
no weight-update process group (no NCCL/gloo broadcast, no ``/init_weights_update_group``);
``/update_weights_from_tensor`` gets SGLang's ``serialized_named_tensors`` with
``load_format="flattened_bucket"``, one handle per engine TP rank.

Each engine TP rank gets a handle of memory on its own GPU, as slime's colocated path
(slime/backends/megatron_utils/update_weight/): every trainer rank iterates the export (the
TP gathers give each the full HF tensors); the ranks whose GPU an engine TP rank runs on pack
each bucket into a staging buffer on their device and serialize its handle with SGLang's
device-UUID reduction (tensor_handles.py); rank 0 gathers the handles and sends each engine
its GPUs' handles. Engines are mapped to trainer ranks by device UUID (:func:`engine_ranks`):
the launch gives the engine at position i of ``--rollout-urls`` the node's GPUs after those of
the engines before it (run_rl_colocate.sh, the launcher), dead engines counted, so an engine
that dies shifts no survivor onto another GPU's handles; each GPU's UUID names the trainer
rank on it. A rank whose GPU no engine runs on shares nothing: a handle never sent would
keep its block in torch's CUDA IPC limbo (below) for nothing.

A staging buffer is never written again once sent: SGLang answers
``update_weights_from_tensor`` before its copies out of the buffer have run on the GPU (no
synchronize in sglang/srt/managers/scheduler_components/weight_updater.py), so each bucket
has a buffer of its own, dropped when its reply has come and the bucket after it is sent;
torch's CUDA IPC reference count then keeps the block from reuse until the engine has
released its mapping, after its stream synchronize (torch/csrc/StorageSharing.cpp). A freed
block whose handle was sent stays allocated in torch's "sent data limbo"
(torch/csrc/CudaIPCTypes.cpp; torch's multiprocessing notes on CUDA sharing) until
``torch.cuda.ipc_collect()``, which ``empty_cache()`` does not do: after the last bucket every
rank drops its buffers, passes a barrier (every engine has answered every bucket), then
collects and empties the cache, as slime does; a bucket's block dropped within the sync is
collected as it is dropped, so the limbo never holds more than the buffers in flight. A rank
holds at most three buckets' buffers (bucket k+2 is packed before bucket k's reply is known
to every rank): the plan's sync phase counts 3 x bucket (train/memory.py). No buffer
outlives the sync, so none is on the GPU during rollout or training.

A bucket is always packed, never sent from parameter memory: sharing a CPU parameter's
storage would move it into shared memory (its address changes under the optimizer), so
``min_direct_bytes`` is disabled and a one-tensor bucket is copied too. Pipeline
parallelism is refused: every engine needs every stage's weights on its own GPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import sys

import torch
import torch.distributed as dist

from megatron_klear import platform
from megatron_klear.rollout.transport.tensor_handles import release_buffer, serialize_bucket, \
    shared_buffer
from megatron_klear.rollout.transport.weight_sync import Bucket, WeightSync, WeightSyncError, _agree

__all__ = ["TensorWeightSync", "HANDLES", "engine_ranks"]

UPDATE_PATH = "/update_weights_from_tensor"


class _Handles:
    """Stands where :class:`WeightSync` keeps its process group: the members are joined
    (their TP sizes read, their trainer ranks found), and there is no group to broadcast
    over."""

    def __init__(self, ranks: dict[str, list[int]]) -> None:
        self.ranks = ranks  # per member URL, the trainer ranks of its TP ranks' GPUs

    def close(self) -> None:
        """Nothing to tear down."""


HANDLES = _Handles  # the type of ``TensorWeightSync.group`` once joined


def engine_ranks(urls: list[str], tp_sizes: dict[str, int], rank_uuids: list[str]
                 ) -> dict[str, list[int]]:
    """Per engine of ``tp_sizes`` (the live ones), the trainer ranks whose GPUs its TP ranks
    run on, in TP order. The engine at position i of ``urls`` (every configured engine, dead
    ones too) runs on the node's GPUs ``offset_i .. offset_i + tp_i - 1``, ``offset_i`` the
    TP sizes of the engines before it (one not in ``tp_sizes``, never seen: the TP size of
    the engines that are, as every colocated engine runs ``--sglang-tp-size``); GPU g's UUID
    (``platform.gpu_uuid``) is found among ``rank_uuids`` (trainer rank r's GPU). Refused
    when an engine TP rank's GPU has no trainer rank: it has no handle it can map."""
    default = next(iter(tp_sizes.values()), 1)
    where = {uuid: r for r, uuid in enumerate(rank_uuids)}
    out, offset = {}, 0
    for url in urls:
        tp = tp_sizes.get(url, default)
        if url in tp_sizes:
            gpus = range(offset, offset + tp)
            uuids = [platform.gpu_uuid(g) if g < len(rank_uuids) else None for g in gpus]
            if not all(u in where for u in uuids):
                raise WeightSyncError(
                    f"{url}: its TP ranks run on GPUs {list(gpus)} (the engines before it in "
                    f"--rollout-urls take {offset}) but the trainer ranks run on "
                    f"{rank_uuids}: each engine TP rank must share a GPU with a trainer rank")
            out[url] = [where[u] for u in uuids]
        offset += tp
    return out


class TensorWeightSync(WeightSync):
    """Trainer side of colocated weight sync (every method except :meth:`probe` is
    collective, as :class:`WeightSync`'s). Takes :class:`WeightSync`'s arguments but the
    transport ones (``backend``, ``master_addr``/``master_port``, ``load_format``,
    ``min_direct_bytes``)."""

    def __init__(self, urls: list[str], model_chunks: list[torch.nn.Module], arch,
                 **kwargs) -> None:
        fixed = {"backend", "master_addr", "master_port", "load_format", "min_direct_bytes"}
        if fixed & kwargs.keys():
            raise ValueError(f"{sorted(fixed & kwargs.keys())}: a tensor-handle sync has no "
                             "process group and always sends flattened buckets")
        super().__init__(urls, model_chunks, arch, load_format="flattened_bucket",
                         master_addr="127.0.0.1", min_direct_bytes=sys.maxsize, **kwargs)
        if self.pp > 1:
            raise WeightSyncError("--colocate with pipeline parallelism: every engine needs "
                                  "every stage's weights on its own GPU; use "
                                  "--pipeline-model-parallel-size 1")

    @property
    def device(self) -> torch.device:
        """Where the staging buffers live: this rank's device (the engines share its GPUs;
        host shared memory for a CPU trainer)."""
        return platform.device()

    def connect(self) -> None:
        """Every rank's GPU UUID, then :meth:`WeightSync.connect` (collective)."""
        self._rank_uuids = [None] * dist.get_world_size()
        gpu = self.device.index  # a CPU trainer: the GPU its rank would have (LOCAL_RANK)
        gpu = int(os.environ.get("LOCAL_RANK", "0")) if gpu is None else gpu
        dist.all_gather_object(self._rank_uuids, platform.gpu_uuid(gpu))
        self._tp_seen: dict[str, int] = {}  # every engine's TP size once seen (dead ones kept)
        self._senders: set[int] | None = None
        super().connect()

    def _join(self) -> None:
        """Source rank: read each member's TP size (one payload entry per engine TP rank) and
        find the trainer ranks of its GPUs (:func:`engine_ranks`)."""
        infos = self.client.server_info()
        for url in self.members:
            info = infos[url] if isinstance(infos[url], dict) else {}
            if int(info.get("pp_size", 1)) != 1:
                raise WeightSyncError(f"{url}: the server runs pp_size={info['pp_size']}; weight "
                                      "sync supports servers with pp_size 1 (use --tp-size)")
            self._tp_seen[url] = int(info.get("tp_size", 1))
        self.group = _Handles(engine_ranks(
            self.urls, {u: self._tp_seen[u] for u in self.members}, self._rank_uuids))

    def _leave(self) -> None:
        self.group = None

    def _send_stage(self, weight_version: str) -> int:
        """The ranks an engine receives from pack and serialize each bucket on their own
        device (the others only take part in the export's collectives); rank 0 gathers the
        handles and POSTs each engine its ranks' (one request in flight: bucket k+1 is packed
        while bucket k's is). A rank drops bucket k's buffer once bucket k+2's handles are
        gathered, when rank 0 has had bucket k's replies; after the last, the IPC limbo is
        collected (module doc). Bytes sent (rank 0)."""
        sent, inflight, error, kept = 0, None, None, collections.deque()
        rank, world = dist.get_rank(), dist.get_world_size()
        senders = [sorted({r for ranks in self.group.ranks.values() for r in ranks})
                   if rank == 0 else None]
        dist.broadcast_object_list(senders, src=0)
        try:
            for bucket, views, _ in self._buckets(self._export()):
                handle = None
                if rank in senders[0]:
                    kept.append(self._pack_own(bucket, views))
                    handle = serialize_bucket(kept[-1], [(s.name, s.shape, s.dtype, s.offset)
                                                         for s in bucket.specs])
                handles = [None] * world if rank == 0 else None
                dist.gather_object(handle, handles, dst=0)
                if rank == 0 and error is None:
                    try:
                        if inflight is not None:
                            sent += self._finish(inflight)
                        inflight = self._start(bucket, handles, weight_version)
                    except Exception as exc:  # noqa: BLE001 - raised on every rank below
                        error, inflight = exc, None
                if len(kept) > 2:
                    release_buffer(kept.popleft())
                    if self.device.type == "cuda":  # bucket k's block out of the IPC limbo
                        torch.cuda.ipc_collect()  # (freed once the engine has unmapped it)
            if inflight is not None and error is None:
                try:
                    sent += self._finish(inflight)
                except Exception as exc:  # noqa: BLE001 - raised on every rank below
                    error = exc
        finally:
            while kept:
                release_buffer(kept.popleft())
        self._collect_ipc()
        _agree(error)
        return sent

    def _collect_ipc(self) -> None:
        """Every rank has dropped its staging buffers and every engine has answered (a
        barrier): free the blocks torch keeps for the receivers (``ipc_collect``), then give
        them back to the driver (``empty_cache``) for the engines' KV cache, as slime does
        (slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py)."""
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    def _pack_own(self, bucket: Bucket, views: list[torch.Tensor]) -> torch.Tensor:
        """A new staging buffer on this rank's device holding the bucket's bytes."""
        buf = shared_buffer(bucket.nbytes, self.device)
        for spec, view in zip(bucket.specs, views):
            size = math.prod(spec.shape) * spec.dtype.itemsize
            buf[spec.offset:spec.offset + size].view(spec.dtype).view(view.shape).copy_(view)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the pack is done before it is mapped
        return buf

    def _start(self, bucket: Bucket, handles: list[str], weight_version: str
               ) -> tuple[concurrent.futures.Future, list, int]:
        """POST each member the handles of the trainer ranks on its GPUs."""
        payloads = {url: {"serialized_named_tensors": [handles[r] for r in ranks],
                          "load_format": "flattened_bucket", "flush_cache": False,
                          "weight_version": weight_version}
                    for url, ranks in self.group.ranks.items()}
        return self.client.post_each_nowait(UPDATE_PATH, payloads), [], bucket.nbytes

    def _finish(self, inflight: tuple[concurrent.futures.Future, list, int]) -> int:
        """Await every member's reply; the bucket's bytes."""
        reply, _, nbytes = inflight
        self._check(reply.result(), UPDATE_PATH)
        return nbytes
