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
TP gathers give each the full HF tensors), packs each bucket into a staging buffer on its own
device and serializes its handle with SGLang's device-UUID reduction (tensor_handles.py);
rank 0 gathers the handles and sends engine e, whose TP ranks run on the GPUs of trainer
ranks ``offset_e .. offset_e + tp_e - 1`` (the launch gives engine i the GPUs ``i*tp ..``,
as run_rl_colocate.sh and the launcher do), exactly those ranks' handles. An engine that
does not see a handle's GPU refuses it (SGLang: "Invalid device_uuid").

A staging buffer is never written again once sent: SGLang answers
``update_weights_from_tensor`` before its copies out of the buffer have run on the GPU (no
synchronize in sglang/srt/managers/scheduler_components/weight_updater.py), so each bucket
has a buffer of its own, dropped when its reply has come and the bucket after it is sent;
torch's CUDA IPC reference count then keeps the block from reuse until the engine has
released its mapping, after its stream synchronize (torch/csrc/StorageSharing.cpp). No
buffer outlives the sync, so none is on the GPU during rollout or training.

A bucket is always packed, never sent from parameter memory: sharing a CPU parameter's
storage would move it into shared memory (its address changes under the optimizer), so
``min_direct_bytes`` is disabled and a one-tensor bucket is copied too. Pipeline
parallelism is refused: every engine needs every stage's weights on its own GPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
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
    (their TP sizes read), and there is no group to broadcast over."""

    def __init__(self, tp_sizes: dict[str, int]) -> None:
        self.tp_sizes = tp_sizes

    def close(self) -> None:
        """Nothing to tear down."""


HANDLES = _Handles  # the type of ``TensorWeightSync.group`` once joined


def engine_ranks(tp_sizes: dict[str, int], world: int) -> dict[str, range]:
    """Per engine URL, the trainer ranks whose GPUs its TP ranks run on (in order): engine e
    on the next ``tp_e`` GPUs. Refused when the engines have more TP ranks than the trainer
    has GPUs (a TP rank with no trainer rank on its GPU has no handle it can map)."""
    out, offset = {}, 0
    for url, tp in tp_sizes.items():
        out[url] = range(offset, offset + tp)
        offset += tp
    if offset > world:
        raise WeightSyncError(f"the colocated engines have {offset} TP ranks "
                              f"({dict(tp_sizes)}) but the trainer runs on {world} GPUs: each "
                              "engine TP rank must share a GPU with a trainer rank")
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

    def _join(self) -> None:
        """Source rank: read each member's TP size (one payload entry per engine TP rank)."""
        infos = self.client.server_info()
        tps = {}
        for url in self.members:
            info = infos[url] if isinstance(infos[url], dict) else {}
            if int(info.get("pp_size", 1)) != 1:
                raise WeightSyncError(f"{url}: the server runs pp_size={info['pp_size']}; weight "
                                      "sync supports servers with pp_size 1 (use --tp-size)")
            tps[url] = int(info.get("tp_size", 1))
        engine_ranks(tps, dist.get_world_size())
        self.group = _Handles(tps)

    def _leave(self) -> None:
        self.group = None

    def _send_stage(self, weight_version: str) -> int:
        """Every rank packs and serializes each bucket on its own device; rank 0 gathers the
        handles and POSTs each engine its ranks' (one request in flight: bucket k+1 is
        packed while bucket k's is). A rank drops bucket k's buffer once bucket k+2's handles
        are gathered, when rank 0 has had bucket k's replies. Bytes sent (rank 0)."""
        sent, inflight, error, kept = 0, None, None, collections.deque()
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            for bucket, views, _ in self._buckets(self._export()):
                buf = self._pack_own(bucket, views)
                kept.append(buf)
                specs = [(s.name, s.shape, s.dtype, s.offset) for s in bucket.specs]
                handles = [None] * world if rank == 0 else None
                dist.gather_object(serialize_bucket(buf, specs), handles, dst=0)
                if rank == 0 and error is None:
                    try:
                        if inflight is not None:
                            sent += self._finish(inflight)
                        inflight = self._start(bucket, handles, weight_version)
                    except Exception as exc:  # noqa: BLE001 - raised on every rank below
                        error, inflight = exc, None
                if len(kept) > 2:
                    release_buffer(kept.popleft())
            if inflight is not None and error is None:
                try:
                    sent += self._finish(inflight)
                except Exception as exc:  # noqa: BLE001 - raised on every rank below
                    error = exc
        finally:
            for buf in kept:
                release_buffer(buf)
        _agree(error)
        return sent

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
        ranks = engine_ranks(self.group.tp_sizes, len(handles))
        payloads = {url: {"serialized_named_tensors": [handles[r] for r in ranks[url]],
                          "load_format": "flattened_bucket", "flush_cache": False,
                          "weight_version": weight_version}
                    for url in self.group.tp_sizes}
        return self.client.post_each_nowait(UPDATE_PATH, payloads), [], bucket.nbytes

    def _finish(self, inflight: tuple[concurrent.futures.Future, list, int]) -> int:
        """Await every member's reply; the bucket's bytes."""
        reply, _, nbytes = inflight
        self._check(reply.result(), UPDATE_PATH)
        return nbytes
