"""Push the trainer's weights to the rollout servers after every update (SGLang protocol).

Per sync: rank 0 pauses generation, flushes the cache and opens the update window
(``/begin_weight_update``); then every pipeline stage streams its own layers; then rank 0
closes the window and resumes generation. Streaming a stage: ``export_hf_weights`` (the
checkpoint bridge's one Megatron -> HF mapping; collective over TP) yields full HF-named
tensors, which the stage's *source rank* packs into buckets of ``bucket_bytes``; per bucket
it POSTs ``/update_weights_from_distributed``, broadcasts the bucket over the weight-update
group and awaits the servers' replies. ``load_format="flattened_bucket"`` (default) sends the
tensors' bytes back to back in one uint8 buffer (one broadcast per bucket, packed into a
reused buffer); ``load_format=None`` broadcasts each tensor as is (no packing copy; the
embedded server receives straight into its parameters). Bucket k+1 is exported and packed
while bucket k is on the wire. Only data-parallel replica 0 exports.

PP design: each pipeline stage's source rank (TP rank 0, DP rank 0) hosts its OWN
weight-update group (``{group_name}_pp{stage}`` when PP > 1) and is rank 0 of it, as SGLang
requires of the trainer; every server joins every stage's group. Stages therefore send in
parallel with no extra copy through rank 0; servers apply requests one at a time.

Correctness probe: :meth:`WeightSync.probe` asks every server for the logprobs of a fixed
sequence and returns the max |server - trainer| (log it as ``weight_sync/probe_max_abs_diff``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_klear import platform
from megatron_klear.rollout.client import RolloutClient, RolloutError
from megatron_klear.rollout.update_group import UpdateGroup, dtype_name, open_update_group

__all__ = ["WeightSync", "WeightSyncError", "iter_buckets", "flatten_bucket",
           "trainer_sequence_logprobs", "PROBE_METRIC"]

log = logging.getLogger("megatron_klear.rollout.weight_sync")

PROBE_METRIC = "weight_sync/probe_max_abs_diff"


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-update request; the message names it."""


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (one larger tensor
    forms a bucket of its own)."""
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]],
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in one uint8 buffer (the flattened_bucket wire format),
    written into ``out`` when given (a reused buffer avoids fresh page faults on CPU)."""
    parts = [t.contiguous().view(-1).view(torch.uint8) for _, t in bucket]
    if out is None:
        return torch.cat(parts)
    return torch.cat(parts, out=out)


def trainer_sequence_logprobs(model: torch.nn.Module, arch, input_ids: list[int]
                              ) -> torch.Tensor | None:
    """The trainer's fp32 logprobs of tokens 1..L-1 of ``input_ids`` (last PP stage; else None).

    Collective over the model-parallel group (runs megatron's forward-only schedule).
    """
    from megatron_klear.checkpoint.convert import megatron_logits

    ids = torch.tensor([input_ids], dtype=torch.long)
    logits = megatron_logits(model, arch, ids)
    if logits is None:
        return None
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    return logp.gather(1, ids[0, 1:, None])[:, 0]


def _parallel_ranks() -> tuple[int, int, int, bool, bool]:
    """(pp stage, pp size, global rank, in DP replica 0, is this stage's source rank)."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    replica0 = ps.get_data_parallel_rank() == 0
    source = replica0 and ps.get_tensor_model_parallel_rank() == 0
    return stage, ps.get_pipeline_model_parallel_world_size(), dist.get_rank(), replica0, source


class WeightSync:
    """Trainer side of weight sync; every method except :meth:`probe` is collective."""

    def __init__(self, urls: list[str], model_chunks: list[torch.nn.Module], arch, *,
                 bucket_bytes: int = 512 * 2**20, group_name: str = "klear_weights",
                 master_addr: str | None = "127.0.0.1", master_port: int | None = None,
                 backend: str | None = None, server_tp: int = 1, dtype: torch.dtype | None = None,
                 pause_mode: str = "abort", load_format: str | None = "flattened_bucket",
                 timeout_s: float = 600.0) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format={load_format!r}: expected None (one broadcast per "
                             "tensor) or 'flattened_bucket' (one per bucket)")
        self.client = RolloutClient(urls, request_timeout_s=timeout_s, max_retries=0)
        self.model_chunks, self.arch = model_chunks, arch
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.stage, pp, self.rank, self.replica0, self.is_source = _parallel_ranks()
        self.group_name = group_name if pp == 1 else f"{group_name}_pp{self.stage}"
        self.master_addr = master_addr or socket.gethostbyname(socket.getfqdn())
        self.master_port = master_port if master_port is None else master_port + self.stage
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.server_tp, self.pause_mode, self.timeout_s = server_tp, pause_mode, timeout_s
        self.load_format = load_format
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")
        self.group: UpdateGroup | None = None
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device)] * 2
        self._sender = concurrent.futures.ThreadPoolExecutor(1)  # bucket k on the wire ...
        self._http = concurrent.futures.ThreadPoolExecutor(1)  # ... while its request waits

    # ------------------------------------------------------------------ group lifecycle
    def connect(self) -> None:
        """Form this stage's weight-update group with every server (collective)."""
        if self.is_source:
            port = self.master_port or _free_port(self.master_addr)
            world = 1 + len(self.client.urls) * self.server_tp
            payloads = {url: {"master_address": self.master_addr, "master_port": port,
                              "rank_offset": 1 + i * self.server_tp, "world_size": world,
                              "group_name": self.group_name, "backend": self.backend}
                        for i, url in enumerate(self.client.urls)}
            replies = self._http.submit(self._post_each, "/init_weights_update_group", payloads)
            self.group = open_update_group(self.master_addr, port, 0, world, self.group_name,
                                           self.backend, self.timeout_s)
            self._check(replies.result(), "/init_weights_update_group")
        dist.barrier()

    def close(self) -> None:
        """Destroy the weight-update groups on servers and trainer (collective)."""
        if self.group is not None:
            self._check(self.client.post_all("/destroy_weights_update_group",
                                             {"group_name": self.group_name}),
                        "/destroy_weights_update_group")
            self.group.close()
            self.group = None
        self._sender.shutdown()
        self._http.shutdown()
        dist.barrier()

    # ------------------------------------------------------------------ sync
    def sync(self, weight_version: str) -> dict[str, float]:
        """Send the current weights to every server, tagged ``weight_version`` (collective).

        Returns (on every rank) ``weight_sync/bytes``, ``weight_sync/seconds`` and
        ``weight_sync/gbps`` (GB/s = 1e9 bytes per second, all stages together).
        """
        if self.is_source and self.group is None:
            raise WeightSyncError("WeightSync.sync before connect(): call connect() once first")
        dist.barrier()  # a probe another rank has in flight finishes before the pause
        start = time.perf_counter()
        if self.rank == 0:
            self._admin_before()
        dist.barrier()
        sent = self._send_stage(weight_version)
        dist.barrier()
        if self.rank == 0:
            self._check(self.client.post_all("/end_weight_update", {}), "/end_weight_update")
            self.client.post_all("/continue_generation", {})
        here = platform.device()  # the default group's device (NCCL needs CUDA tensors)
        total = torch.tensor([float(sent)], dtype=torch.float64, device=here)
        dist.all_reduce(total)
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=here)
        dist.broadcast(seconds, src=0)
        metrics = {"weight_sync/bytes": float(total), "weight_sync/seconds": float(seconds),
                   "weight_sync/gbps": float(total) / max(float(seconds), 1e-9) / 1e9}
        if self.rank == 0:
            log.info("weight sync %s: %.1f MB in %.3f s (%.3f GB/s)", weight_version,
                     metrics["weight_sync/bytes"] / 1e6, metrics["weight_sync/seconds"],
                     metrics["weight_sync/gbps"])
        return metrics

    def _admin_before(self) -> None:
        self.client.post_all("/pause_generation", {"mode": self.pause_mode})
        self._flush_cache()
        self._check(self.client.post_all("/begin_weight_update", {}), "/begin_weight_update")

    def _flush_cache(self, wait_s: float = 30.0) -> None:
        """GET /flush_cache until every server accepts (400 while aborted requests drain)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.client.get_all("/flush_cache")
                return
            except RolloutError as exc:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"flush_cache refused for {wait_s:.0f}s: {exc}") from exc
                time.sleep(0.05)

    def _send_stage(self, weight_version: str) -> int:
        """Stream this stage's tensors (all TP ranks iterate; the source sends). Bytes sent.

        Pipelined: bucket k+1 is exported and packed while bucket k is on the wire.
        """
        if not self.replica0:
            return 0
        named = self._export()
        if not self.is_source:
            for _ in named:  # the TP all-gathers inside the export are collective
                pass
            return 0
        sent, inflight = 0, None
        for i, bucket in enumerate(iter_buckets(named, self.bucket_bytes)):
            payload, tensors = self._pack(bucket, weight_version, slot=i % 2)
            if inflight is not None:
                sent += inflight.result()
            inflight = self._sender.submit(self._transfer, payload, tensors)
        return sent + (inflight.result() if inflight is not None else 0)

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron_klear.checkpoint.hf_bridge import export_hf_weights

        for name, t in export_hf_weights(self.model_chunks, self.arch, copy=False):
            yield name, t if self.dtype is None else t.to(self.dtype)

    def _pack(self, bucket: list[tuple[str, torch.Tensor]], weight_version: str,
              slot: int) -> tuple[dict, list[torch.Tensor]]:
        """The request of one bucket and the tensors to broadcast (one flat buffer, or each)."""
        payload = {"names": [n for n, _ in bucket],
                   "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                   "shapes": [list(t.shape) for _, t in bucket],
                   "group_name": self.group_name, "flush_cache": False,
                   "weight_version": weight_version, "load_format": self.load_format}
        if self.load_format != "flattened_bucket":
            return payload, [t.contiguous() for _, t in bucket]
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if self._buffers[slot].numel() < nbytes:  # grow-only: pages stay mapped across syncs
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return payload, [flatten_bucket(bucket, out=self._buffers[slot][:nbytes])]

    def _transfer(self, payload: dict, tensors: list[torch.Tensor]) -> int:
        """POST the request, broadcast its tensors in order, await every server's reply."""
        replies = self._http.submit(self.client.post_all, "/update_weights_from_distributed",
                                    payload)
        for t in tensors:
            self.group.broadcast(t if t.device == self.device else t.to(self.device))
        self._check(replies.result(), "/update_weights_from_distributed")
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ probe
    def probe(self, input_ids: list[int], trainer_logprobs: torch.Tensor) -> float:
        """Max |server - trainer| logprob of tokens 1..L-1 of ``input_ids`` over all servers.

        Not collective: call it where ``trainer_logprobs`` live (the last PP stage), e.g.
        with :func:`trainer_sequence_logprobs`.
        """
        ref = trainer_logprobs.detach().double().flatten()
        diffs = []
        for lps in self.client.prompt_logprobs(list(input_ids)):
            got = torch.tensor(lps, dtype=torch.float64)
            if got.shape != ref.shape:
                raise WeightSyncError(f"probe: servers returned {got.numel()} logprobs, the "
                                      f"trainer has {ref.numel()} (tokens 1..L-1)")
            diffs.append(float((got - ref).abs().max()))
        return max(diffs)

    # ------------------------------------------------------------------ helpers
    def _post_each(self, path: str, payloads: dict[str, dict]) -> dict[str, Any]:
        """POST a per-server payload to each server concurrently."""
        with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
            futures = {url: pool.submit(RolloutClient([url], request_timeout_s=self.timeout_s)
                                        .post_all, path, body) for url, body in payloads.items()}
            return {url: f.result()[url] for url, f in futures.items()}

    @staticmethod
    def _check(replies: dict[str, Any], path: str) -> None:
        for url, reply in replies.items():
            if isinstance(reply, dict) and reply.get("success") is False:
                raise WeightSyncError(f"{url}{path} failed: {reply.get('message')}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
