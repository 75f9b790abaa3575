"""Colocated weight sync: the trainer passes its weights to engines on its own node by handle.

:class:`TensorWeightSync` is :class:`~megatron_klear.rollout.weight_sync.WeightSync` with
another transport: the same export (``hf_bridge.export_views``: the one Megatron -> HF
mapping), the same bucket plan (``plan_bucket``/``aligned_order``: SGLang's flattened,
aligned layout), the same session (pause, flush, ``/begin_weight_update`` ...
``/end_weight_update``, resume; cleanup on failure), the same probe. What differs: there is
no weight-update process group (no NCCL/gloo broadcast, no ``/init_weights_update_group``);
each bucket is packed into one of two staging buffers that another process can map
(``tensor_handles.shared_buffer``: CUDA IPC on a GPU, shared memory on a CPU) and POSTed to
``/update_weights_from_tensor`` as SGLang's ``serialized_named_tensors`` with
``load_format="flattened_bucket"``; the engine copies the tensors out of the trainer's
memory before it answers, so the buffer is free for the bucket after next (one request in
flight, bucket k+1 packed meanwhile, as in the broadcast path).

A bucket is always packed, never sent from parameter memory: sharing a CPU parameter's
storage would move it into shared memory (its address changes under the optimizer), so
``min_direct_bytes`` is disabled and a one-tensor bucket is copied too.

Differences from slime's colocated path (slime/backends/megatron_utils/update_weight/),
labelled "not run on a GPU": there each trainer rank hands the engine TP rank on its own GPU
a handle of its own gathered copy; here the stage's source rank alone packs and every
engine TP rank maps that one buffer (entries of ``serialized_named_tensors`` are separate
pickles of the same buffer: each handle serves one receiver). On a GPU the sender pickles
the CUDA device index; SGLang maps a device UUID when the sender ran its
``monkey_patch_torch_reductions`` (sglang/srt/utils/patch_torch.py), so trainer and engine
must see the GPUs in the same order.
"""

from __future__ import annotations

import concurrent.futures
import sys

import torch

from megatron_klear.rollout.tensor_handles import serialize_bucket, shared_buffer
from megatron_klear.rollout.weight_sync import Bucket, WeightSync, WeightSyncError, \
    update_backend

__all__ = ["TensorWeightSync", "HANDLES"]

UPDATE_PATH = "/update_weights_from_tensor"


class _Handles:
    """Stands where :class:`WeightSync` keeps its process group: the members are joined
    (their TP sizes read), and there is no group to broadcast over."""

    def __init__(self, tp_sizes: dict[str, int]) -> None:
        self.tp_sizes = tp_sizes

    def close(self) -> None:
        """Nothing to tear down."""


HANDLES = _Handles  # the type of ``TensorWeightSync.group`` once joined


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

    def _join(self) -> None:
        """Source rank: read each member's TP size (one payload entry per engine TP rank) and
        device: the staging buffers live on the GPU (CUDA IPC) when the trainer and every
        engine compute on CUDA -- ``update_backend`` answers "nccl" exactly then -- else in
        host shared memory (a CPU engine cannot map a CUDA handle)."""
        infos = self.client.server_info()
        tps, devices = {}, []
        for url in self.members:
            info = infos[url] if isinstance(infos[url], dict) else {}
            if int(info.get("pp_size", 1)) != 1:
                raise WeightSyncError(f"{url}: the server runs pp_size={info['pp_size']}; weight "
                                      "sync supports servers with pp_size 1 (use --tp-size)")
            tps[url] = int(info.get("tp_size", 1))
            devices.append(str(info.get("device") or "cuda"))
        self.backend = update_backend(devices)  # only selects self.device: no group is formed
        self.group = _Handles(tps)

    def _leave(self) -> None:
        self.group = None

    def _pack(self, bucket: Bucket, views: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
        """The bucket's bytes in the shareable staging buffer ``slot`` (always a copy)."""
        if self._buffers[slot].numel() < bucket.nbytes or \
                self._buffers[slot].device != self.device:
            self._buffers[slot] = shared_buffer(bucket.nbytes, self.device)
        buf = self._buffers[slot]
        (out,) = super()._pack(bucket, views, slot)
        if out.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
            out = buf[:bucket.nbytes].copy_(out)  # a one-tensor bucket: not its own memory
        return [out]

    def _start(self, bucket: Bucket, tensors: list[torch.Tensor], weight_version: str
               ) -> tuple[concurrent.futures.Future, list, int]:
        """POST the bucket's handles to every member (each TP rank its own pickle)."""
        (flat,) = tensors
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the pack is done before it is mapped
        specs = [(s.name, s.shape, s.dtype, s.offset) for s in bucket.specs]
        payloads = {url: {"serialized_named_tensors": [serialize_bucket(flat, specs)
                                                       for _ in range(tp)],
                          "load_format": "flattened_bucket", "flush_cache": False,
                          "weight_version": weight_version}
                    for url, tp in self.group.tp_sizes.items()}
        return self.client.post_each_nowait(UPDATE_PATH, payloads), [], bucket.nbytes

    def _finish(self, inflight: tuple[concurrent.futures.Future, list, int]) -> int:
        """Await every member's reply (it has copied the bucket out); the bucket's bytes."""
        reply, _, nbytes = inflight
        self._check(reply.result(), UPDATE_PATH)
        return nbytes
