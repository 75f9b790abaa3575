"""Push the trainer's weights to the rollout servers after every update (SGLang protocol).

Per sync: rank 0 checks which servers are alive (a dead one leaves the weight-update group, a
restarted one rejoins: the group is re-formed and it receives the full weights), pauses
generation, flushes the cache and opens the update session (``/begin_weight_update``); then
the pipeline stages stream their layers one stage after another; then -- always, also after a
failure -- rank 0 closes the session (``/end_weight_update``) and resumes generation
(``/continue_generation``), so no server is left paused or with an open session.

Streaming a stage: ``hf_bridge.export_views`` (the checkpoint bridge's one Megatron -> HF
mapping; collective over TP) yields each HF tensor as a view of the Megatron parameter (or of
the TP-gathered shards), which the stage's *source rank* copies once, straight into its place
in a bucket buffer; per bucket one POST ``/update_weights_from_distributed`` and one broadcast
over the weight-update group. ``load_format="flattened_bucket"`` (default) sends the tensors'
bytes back to back in one uint8 buffer, largest element size first so every tensor starts at
an offset aligned to its dtype (SGLang's ``FlattenedTensorBucket`` refuses others);
``load_format=None`` broadcasts each tensor as is. The buckets (membership, offsets, request
bodies) are planned by the first sync and reused; the first bucket is small so the wire starts
early, and a bucket of one contiguous tensor is sent from its own memory. Where the exported
tensors already lie back to back in parameter memory (megatron DDP with the distributed
optimizer keeps all parameters of a dtype in one buffer: everything of a layer but its q/k/v),
a run of at least ``min_direct_bytes`` is a bucket sent from that memory with no pack
(:func:`adjacent_runs`, :meth:`WeightSync._place`). Pipelining: bucket
k+1 is packed while bucket k's broadcast (``async_op``) and request are in flight, on a thread
of the lowest CPU priority so that the pack yields to the transfer; request k+1 is POSTed once
every server answered bucket k (one request in flight: concurrent requests may reach a server
in either order). Only data-parallel replica 0 exports.

Group formation (sglang/srt/model_executor/model_runner_components/weight_updater.py): SGLang
server i joins as ``rank_offset_i + tp_rank``; its TP size is read from ``GET /server_info``,
so ``rank_offset_i = 1 + sum(tp_j, j < i)`` and ``world_size = 1 + sum(tp)``. The trainer is
rank 0 and hosts the store (update_group.py), at ``master_addr``: by default this host's
address on the route to the first server (routable when the servers run on other nodes).
The group's backend follows the servers' ``device`` in ``/server_info`` (:func:`update_backend`):
NCCL between a GPU trainer and GPU servers, gloo as soon as one side computes on the CPU (the
embedded server), the trainer then staging each bucket in host memory.

PP design: each stage's source rank (TP rank 0, DP rank 0) hosts its OWN weight-update group
(``{group_name}_pp{stage}`` when PP > 1). Each SGLang server handles weight requests one at a
time in arrival order, so stages that sent concurrently could reach two servers in opposite
orders and deadlock; stages therefore form their groups and send one after another. The
stages' source ranks may sit on different nodes, so each hosts its store at an address of its
own node (:func:`stage_master_addr`: ``--weight-sync-master-addr`` where this node owns it).

Correctness probe: :meth:`WeightSync.probe` asks every server for the logprobs of a fixed
sequence and returns the max |server - trainer|; :mod:`megatron_klear.rollout.transport.probe` runs it
after a sync (those ``--probe-interval`` names), in either placement
(``weight_sync/probe_max_abs_diff``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_klear import platform
from megatron_klear.rollout.orchestration.client import RolloutClient, RolloutError
from megatron_klear.distributed import free_port
from megatron_klear.rollout.transport.update_group import (UpdateGroup, dtype_name,
                                                           is_local_address, open_update_group,
                                                           routable_address)

__all__ = ["WeightSync", "WeightSyncError", "iter_buckets", "aligned_order", "plan_bucket",
           "adjacent_runs", "MIN_DIRECT_BYTES",
           "Bucket", "TensorSpec", "rank_layout", "lowest_cpu_priority",
           "update_backend", "stage_master_addr"]

log = logging.getLogger("megatron_klear.rollout.transport.weight_sync")

# the first bucket is this fraction of bucket_bytes: the wire waits only for its short pack,
# later buckets are packed while the previous one is on the wire
FIRST_BUCKET_FRACTION = 8
# a run of tensors adjacent in parameter memory at least this big is a bucket of its own, sent
# with no pack; smaller runs are packed. Each bucket costs a request round trip (about 2 ms
# here): measured, all runs direct lost at Qwen3-0.6B's 22 MiB per layer (median 0.76 vs 0.84
# of the raw broadcast; 0.75-0.78 vs 0.79-0.87 with about 2 ms per request, docs/rollout.md)
# and won at Qwen3-1.7B's 80 MiB (0.92 vs 0.80) and 4B's 162 MiB
MIN_DIRECT_BYTES = 64 * 2**20


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-update request; the message names it."""


def _tensor_nbytes(item: tuple) -> int:
    return item[1].numel() * item[1].element_size()


def iter_buckets(named: Iterable[tuple], bucket_bytes: int,
                 nbytes: Callable[[tuple], int] = _tensor_nbytes,
                 first_bucket_bytes: int | None = None) -> Iterator[list[tuple]]:
    """Group ``(name, tensor, ...)`` items in order into buckets of at most ``bucket_bytes``
    (``first_bucket_bytes`` for the first; ``nbytes(item)`` each; one larger tensor forms a
    bucket of its own)."""
    bucket, size, limit = [], 0, first_bucket_bytes or bucket_bytes
    for item in named:
        n = nbytes(item)
        if bucket and size + n > limit:
            yield bucket
            bucket, size, limit = [], 0, bucket_bytes
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a bucket: HF name, shape, wire dtype, byte offset in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One request's tensors (export order), their bytes, and the request body without its
    ``weight_version`` (computed once, reused by every sync)."""

    specs: tuple[TensorSpec, ...]
    nbytes: int
    flattened: bool
    payload: dict


def plan_bucket(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], flattened: bool,
                group_name: str) -> Bucket:
    """A bucket of ``(name, HF shape, wire dtype)`` in export order. ``flattened``: offsets
    in the flat buffer follow :func:`aligned_order`, and the request lists the tensors in
    that (wire) order; otherwise each tensor is its own broadcast, in export order."""
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in tensors]
    order = aligned_order(list(range(len(tensors))), key=lambda i: tensors[i][2].itemsize) \
        if flattened else list(range(len(tensors)))
    offsets, offset = [0] * len(tensors), 0
    for i in order:
        offsets[i], offset = offset, offset + sizes[i]
    specs = tuple(TensorSpec(n, tuple(s), d, o) for (n, s, d), o in zip(tensors, offsets))
    wire = [specs[i] for i in order]
    payload = {"names": [t.name for t in wire], "dtypes": [dtype_name(t.dtype) for t in wire],
               "shapes": [list(t.shape) for t in wire], "group_name": group_name,
               "flush_cache": False, "load_format": "flattened_bucket" if flattened else None}
    return Bucket(specs, sum(sizes), flattened, payload)


def adjacent_runs(views: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[list[int]]:
    """Indices of ``views``, grouped into maximal runs that are adjacent in memory: each run's
    views are contiguous, of their wire dtype (``dtypes``), of one storage and dtype, and
    follow each other with no byte in between, listed in memory order. Such a run's bytes
    are a flattened bucket as they lie (with the distributed optimizer megatron's DDP keeps
    every parameter of a dtype in one ``param_data`` buffer: all but the de-interleaved
    q/k/v of a layer are adjacent). Views that are in no run of two or more form runs of
    one where they are contiguous; the rest are in no run."""
    placed = sorted((v.untyped_storage().data_ptr(), v.data_ptr(), i)
                    for i, v in enumerate(views)
                    if v.is_contiguous() and v.dtype == dtypes[i] and v.numel() > 0)
    runs: list[list[int]] = []
    end, storage = None, None
    for base, ptr, i in placed:
        v = views[i]
        if runs and base == storage and ptr == end and v.dtype == views[runs[-1][-1]].dtype:
            runs[-1].append(i)
        else:
            runs.append([i])
        storage, end = base, ptr + v.numel() * v.element_size()
    return runs


def update_backend(server_devices: list[str]) -> str:
    """The weight-update group's backend: NCCL only when the trainer and every server compute
    on CUDA (NCCL moves CUDA tensors only, so a CPU server -- the embedded one -- cannot
    receive over it), else gloo, whose broadcasts the trainer stages through host memory.
    ``server_devices``: each server's ``device`` in ``/server_info`` (SGLang reports its
    resolved ``--device`` there; an older server without the field runs on CUDA)."""
    on_cuda = platform.device().type == "cuda" and all(d == "cuda" for d in server_devices)
    return "nccl" if on_cuda else "gloo"


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
                 master_addr: str | None = None, master_port: int | None = None,
                 backend: str | None = None, dtype: torch.dtype | None = None,
                 pause_mode: str = "abort", load_format: str | None = "flattened_bucket",
                 rollout_client: RolloutClient | None = None,
                 timeout_s: float = 600.0, flush_cache: bool = True,
                 min_direct_bytes: int = MIN_DIRECT_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be > 0")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format={load_format!r}: expected None (one broadcast per "
                             "tensor) or 'flattened_bucket' (one per bucket)")
        self.urls = [u.rstrip("/") for u in urls]
        self.members: list[str] = []  # the servers in the current weight-update group
        self.rollout_client = rollout_client  # generation goes only to members (rank 0)
        self.model_chunks, self.arch = model_chunks, arch
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.min_direct_bytes = min_direct_bytes  # see MIN_DIRECT_BYTES
        self.stage, self.pp, self.rank, self.replica0, self.is_source = _parallel_ranks()
        self.group_name = group_name if self.pp == 1 else f"{group_name}_pp{self.stage}"
        self.master_addr = stage_master_addr(master_addr, self.urls[0], self.pp)
        self.master_port = master_port if master_port is None else master_port + self.stage
        self.requested_backend = backend  # None: update_backend() of the servers' devices
        self.backend = backend or "gloo"  # set by _join once the servers are known
        self.pause_mode, self.timeout_s, self.load_format = pause_mode, timeout_s, load_format
        # flushing waits for an idle server: only right when nothing stays in flight (an
        # in_place/retract pause keeps its requests; an aborted one comes back as a retry)
        self.flush_cache = flush_cache
        self.group: UpdateGroup | None = None
        self._client: RolloutClient | None = None
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * 2
        self._http = concurrent.futures.ThreadPoolExecutor(1)  # init requests
        # packs bucket k+1 while bucket k is on the wire, at the lowest priority
        self._packer = concurrent.futures.ThreadPoolExecutor(1, initializer=lowest_cpu_priority)
        from megatron_klear.checkpoint.hf_bridge import export_aliases, export_entries

        self._entries = export_entries(model_chunks, arch)  # the RULES walk, once per run
        # views made anew each sync: TP gathers, or LoRA weights merged layer by layer
        self._gathers = not export_aliases(self._entries)
        self._views: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
        self._views_storage: list[int] | None = None
        self._plan: list[Bucket] | None = None  # the buckets, planned by the first sync
        self._placed: tuple[list, list] | None = None  # (views, _place(views)) when aliased
        self._copies: dict[tuple[int, int], list] = {}  # per (bucket, buffer): destinations

    @property
    def client(self) -> RolloutClient:
        """The client of the current members (no retries: a weight request is not
        repeatable); one object while the members stay, so a sync keeps its connections."""
        urls = self.members or self.urls
        if self._client is None or self._client.urls != urls:
            self._client = RolloutClient(urls, request_timeout_s=self.timeout_s, max_retries=0)
        return self._client

    @property
    def device(self) -> torch.device:
        """Where the broadcast tensors live: the GPU for NCCL, host memory for gloo."""
        return platform.device() if self.backend == "nccl" else torch.device("cpu")

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket this rank sends per sync (the plan; empty before a sync)."""
        return [b.nbytes for b in self._plan or []]

    @property
    def direct_bytes(self) -> int:
        """Bytes of this rank's buckets sent from the parameters' own memory, with no pack
        (:meth:`_place`; 0 before a sync)."""
        return sum(b.nbytes for b, _, flat in (self._placed or ((), ()))[1] if flat is not None)

    # ------------------------------------------------------------------ group lifecycle
    def connect(self) -> None:
        """Form the weight-update groups with every live server (collective)."""
        self._reform(self._live_urls())

    def close(self) -> None:
        """Destroy the weight-update groups on servers and trainer (collective)."""
        self._per_stage(self._leave)
        self.members = []
        self._http.shutdown()
        self._packer.shutdown()

    def _live_urls(self) -> list[str]:
        """The servers that answer /health, as rank 0 sees them (collective)."""
        held = [None]
        if self.rank == 0:  # the sync's client (kept alive) where it covers every server
            client = self.client if self.client.urls == self.urls else RolloutClient(self.urls)
            held[0] = [u for u, ok in client.health().items() if ok]
        dist.broadcast_object_list(held, src=0)
        return held[0]

    def _reform(self, urls: list[str]) -> None:
        """(Re)form every stage's group with ``urls`` (collective)."""
        if not urls:
            raise WeightSyncError(f"no rollout server is alive (of {self.urls}); restart them "
                                  "and rerun: the run resumes from its last checkpoint")
        self._per_stage(self._leave)
        self.members = list(urls)
        self._per_stage(self._join)
        if self.rank == 0 and self.rollout_client is not None:
            self.rollout_client.set_active(self.members)

    def _leave(self) -> None:
        """Source rank: destroy this stage's group on the trainer and on live servers."""
        if self.group is None:
            return
        self.group.close()
        self.group = None
        self._destroy_on_servers([u for u, ok in RolloutClient(self.members).health().items()
                                  if ok])

    def _destroy_on_servers(self, urls: list[str]) -> None:
        """Best effort: drop this stage's group name on ``urls`` (a server that fails here
        fails the next init loudly; one without the group answers 400, ignored)."""
        for url in urls:
            with contextlib.suppress(RolloutError):
                RolloutClient([url], request_timeout_s=self.timeout_s).post_all(
                    "/destroy_weights_update_group", {"group_name": self.group_name})

    def _join(self) -> None:
        """Source rank: host this stage's group; every member joins with its TP ranks."""
        self._destroy_on_servers(self.members)  # left by an earlier run against these servers
        infos = self.client.server_info()
        tps, devices = [], []
        for url in self.members:
            info = infos[url] if isinstance(infos[url], dict) else {}
            if int(info.get("pp_size", 1)) != 1:
                raise WeightSyncError(f"{url}: the server runs pp_size={info['pp_size']}; weight "
                                      "sync supports servers with pp_size 1 (use --tp-size)")
            if int(info.get("dp_size", 1)) != 1:  # SGLang asserts it too, less clearly
                raise WeightSyncError(
                    f"{url}: the server runs dp_size={info['dp_size']}; SGLang updates weights "
                    "from distributed only without data-parallel replicas "
                    "(tokenizer_control_mixin.py); start one server per replica and list "
                    "each in --rollout-urls")
            tps.append(int(info.get("tp_size", 1)))
            devices.append(str(info.get("device") or "cuda"))
        self.backend = self.requested_backend or update_backend(devices)
        port = self.master_port or free_port(self.master_addr)
        offsets, world = rank_layout(tps)
        payloads = {url: {"master_address": self.master_addr, "master_port": port,
                          "rank_offset": offset, "world_size": world,
                          "group_name": self.group_name, "backend": self.backend}
                    for url, offset in zip(self.members, offsets)}
        replies = self._http.submit(self._post_each, "/init_weights_update_group", payloads)
        try:
            self.group = open_update_group(self.master_addr, port, 0, world, self.group_name,
                                           self.backend, self.timeout_s)
        finally:
            self._check(replies.result(), "/init_weights_update_group")

    def _per_stage(self, work, whole_stage: bool = False) -> None:
        """Run ``work`` on each stage's source rank (``whole_stage``: on all its ranks), stage
        after stage (collective); a failure on any rank is raised on every rank."""
        for stage in range(self.pp):
            error = None
            if self.stage == stage and (self.is_source or whole_stage):
                try:
                    work()
                except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                    error = exc
            _agree(error)

    # ------------------------------------------------------------------ sync
    def sync(self, weight_version: str) -> dict[str, float]:
        """Send the current weights to every live server, tagged ``weight_version``
        (collective).

        Returns (on every rank) ``weight_sync/bytes``, ``weight_sync/seconds`` and
        ``weight_sync/gbps`` (GB/s = 1e9 bytes per second, all stages together). On failure
        every server is resumed and every rank raises :class:`WeightSyncError`.
        """
        sent = [0]

        def send() -> None:
            sent[0] = self._send_stage(weight_version)

        # one event loop and one connection per server for the whole sync, health check too
        # (a re-formed group's members get a client of their own, kept alive in turn)
        with contextlib.ExitStack() as kept:
            kept.enter_context(self.client.keep_alive())
            live = self._live_urls()
            if live != self.members or (self.is_source and self.group is None):
                kept.close()
                self._reform(live)
                kept.enter_context(self.client.keep_alive())
            start = time.perf_counter()
            try:
                error = None
                if self.rank == 0:
                    try:
                        self._admin_before()
                    except Exception as exc:  # noqa: BLE001 - re-raised on every rank
                        error = exc
                _agree(error)
                self._per_stage(send, whole_stage=True)
            except WeightSyncError:
                self._per_stage(self._leave)  # the group may be mid-broadcast: re-form later
                raise
            finally:
                if self.rank == 0:
                    self._admin_after()
        here = platform.device()  # the default group's device (NCCL needs CUDA tensors)
        total = torch.tensor([float(sent[0])], dtype=torch.float64, device=here)
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
        if self.flush_cache:
            self._flush_cache()
        self._check(self.client.post_all("/begin_weight_update", {}), "/begin_weight_update")

    def _admin_after(self) -> None:
        """Close the update session and resume generation on every member, each attempted even
        when another fails (a server left paused would block every later /generate)."""
        problems = []
        for path in ("/end_weight_update", "/continue_generation"):
            replies = self.client.post_all(path, {}, return_errors=True)
            problems += [str(r) for r in replies.values() if isinstance(r, Exception)]
        if problems:
            log.warning("after weight sync: %s", "; ".join(problems))

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

        Pipelined: bucket k+1 is packed while bucket k's broadcast (``async_op``) and its
        request are in flight; one request in flight at a time.
        """
        if not self.replica0 and not self.arch.is_moe:
            return 0
        items = self._export()
        if not self.is_source:
            # the TP all-gathers inside the export are collective; with MoE, so are the
            # expert gathers over EP and expert-TP groups, which megatron carves out of the
            # data-parallel ranks: every replica then iterates (the source alone sends)
            for _ in items:
                pass
            return 0
        sent, inflight = 0, None
        try:
            for i, (bucket, views, flat) in enumerate(self._buckets(items)):
                tensors = [flat] if flat is not None else \
                    self._packer.submit(self._pack, bucket, views, i % 2).result()
                if inflight is not None:
                    sent += self._finish(inflight)
                inflight = self._start(bucket, tensors, weight_version)
            inflight, last = None, inflight
            return sent + (self._finish(last) if last is not None else 0)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight sync {weight_version!r} of stage {self.stage} failed "
                                  f"after {sent / 1e6:.1f} MB: {type(exc).__name__}: {exc}; "
                                  "the servers were resumed with their previous weights "
                                  "partly overwritten, rerun to resume from the last "
                                  "checkpoint") from exc
        finally:
            if inflight is not None:  # never leave a broadcast running on the group
                with contextlib.suppress(Exception):
                    self._finish(inflight)

    def _export(self) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        """(HF name, view, HF shape) of this stage's tensors (hf_bridge.export_views). Without
        gathers the views are of the parameters: made once, reused while every parameter
        keeps its storage (the optimizer updates in place)."""
        from megatron_klear.checkpoint.hf_bridge import export_views

        if self._gathers:
            return export_views(self._entries, self.arch)
        storage = [p.data_ptr() for p, _, _ in self._entries]
        if storage != self._views_storage:
            self._views = list(export_views(self._entries, self.arch))
            self._views_storage = storage
        return iter(self._views)

    def _buckets(self, items: Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]
                 ) -> Iterator[tuple[Bucket, list[torch.Tensor], torch.Tensor | None]]:
        """(bucket, its views in the bucket's spec order, its bytes where they already lie
        back to back in parameter memory, else None). Views that alias the parameters
        (flattened, no gathers) follow :meth:`_place`, made again only when the views are;
        else the first sync plans the buckets from the export stream and later syncs
        follow that plan (names checked), with no re-planning."""
        if self.load_format == "flattened_bucket" and not self._gathers:
            views = list(items)  # made once by _export while the parameters keep their storage
            old = self._placed[0] if self._placed is not None else []
            if len(old) != len(views) or any(a[1] is not b[1] for a, b in zip(views, old)):
                self._placed = (views, self._place(views))
            self._plan = [bucket for bucket, _, _ in self._placed[1]]
            yield from self._placed[1]
            return
        if self._plan is not None:
            for bucket in self._plan:
                views = []
                for spec in bucket.specs:
                    name, view, _ = next(items)
                    if name != spec.name:
                        raise WeightSyncError(f"the export yielded {name!r} where the bucket "
                                              f"plan has {spec.name!r}: the model changed "
                                              "since the first sync; build a new WeightSync")
                    views.append(view)
                yield bucket, views, None
            return
        plan = []
        first = max(1, self.bucket_bytes // FIRST_BUCKET_FRACTION)
        for group in iter_buckets(items, self.bucket_bytes, self._nbytes, first):
            plan.append(plan_bucket([(n, s, self.dtype or v.dtype) for n, v, s in group],
                                    self.load_format == "flattened_bucket", self.group_name))
            yield plan[-1], [v for _, v, _ in group], None
        self._plan = plan

    def _place(self, items: list[tuple[str, torch.Tensor, tuple[int, ...]]]
               ) -> list[tuple[Bucket, list[torch.Tensor], torch.Tensor | None]]:
        """The flattened buckets of views that alias the parameters. Every run of adjacent
        views (:func:`adjacent_runs`) of at least ``min_direct_bytes`` is sent from the
        parameters' own memory (split at ``bucket_bytes``; its specs in memory order), so
        only the rest (q/k/v de-interleaved, dtype casts, small runs) is packed, into buckets
        formed in export order as before. Buckets go in the export order of their first
        tensor: the same on every rank, the big direct buckets on the wire while the packed
        ones are copied. Without a run of ``min_direct_bytes`` (e.g. small layers and no
        distributed optimizer: a storage per parameter) this is the streamed plan, bucket
        for bucket."""
        dtypes = [self.dtype or v.dtype for _, v, _ in items]
        size = [self._nbytes(item) for item in items]
        direct = []
        for run in adjacent_runs([v for _, v, _ in items], dtypes):
            if sum(size[i] for i in run) >= self.min_direct_bytes:
                direct += iter_buckets(run, self.bucket_bytes, size.__getitem__)
        rest = sorted(set(range(len(items))).difference(*direct))
        small_first = rest and not any(min(d) < rest[0] for d in direct)
        first = max(1, self.bucket_bytes // FIRST_BUCKET_FRACTION) if small_first else None
        groups = direct + list(iter_buckets(rest, self.bucket_bytes, size.__getitem__, first))
        placed = []
        for group in sorted(groups, key=min):
            bucket = plan_bucket([(items[i][0], items[i][2], dtypes[i]) for i in group], True,
                                 self.group_name)
            views = [items[i][1] for i in group]
            placed.append((bucket, views, _flat_range(views, bucket) if group in direct
                           else None))
        return placed

    def _nbytes(self, item: tuple[str, torch.Tensor, tuple[int, ...]]) -> int:
        dtype = self.dtype or item[1].dtype
        return item[1].numel() * dtype.itemsize

    def _pack(self, bucket: Bucket, views: list[torch.Tensor], slot: int) -> list[torch.Tensor]:
        """The tensors to broadcast: each view copied once, straight into its place in the
        flat buffer (flattened_bucket; a bucket of one contiguous tensor, e.g. the embedding
        at TP=1, is sent from the tensor's own memory), or each tensor as is (per tensor:
        copied only where the HF tensor is not a contiguous view, or its dtype changes)."""
        if not bucket.flattened:
            return [v.reshape(spec.shape).to(spec.dtype).contiguous()
                    for spec, v in zip(bucket.specs, views)]
        only = views[0]
        if len(views) == 1 and only.is_contiguous() and only.dtype == bucket.specs[0].dtype:
            return [only.reshape(-1).view(torch.uint8)]  # its own bytes are the bucket
        if self._buffers[slot].numel() < bucket.nbytes or \
                self._buffers[slot].device != self.device:  # grow-only: pages stay mapped
            self._buffers[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8,
                                              device=self.device)
        buf = self._buffers[slot]
        key = (id(bucket), buf.data_ptr())
        if key not in self._copies:  # each tensor's place in the buffer, made once
            self._copies[key] = [
                buf[t.offset:t.offset + math.prod(t.shape) * t.dtype.itemsize]
                .view(t.dtype).view(v.shape) for t, v in zip(bucket.specs, views)]
        for dst, v in zip(self._copies[key], views):
            dst.copy_(v)
        return [buf[:bucket.nbytes]]

    def _start(self, bucket: Bucket, tensors: list[torch.Tensor], weight_version: str
               ) -> tuple[concurrent.futures.Future, list, int]:
        """POST the bucket's request and start its broadcasts (``async_op``); returns what
        :meth:`_finish` awaits. One request in flight at a time: servers may take concurrent
        requests in either order, and a server in the wrong bucket's broadcast deadlocks
        the group."""
        payload = dict(bucket.payload, weight_version=weight_version)
        reply = self.client.post_all_nowait("/update_weights_from_distributed", payload)
        works = [self.group.broadcast(t if t.device == self.device else t.to(self.device),
                                      async_op=True) for t in tensors]
        return reply, works, bucket.nbytes

    def _finish(self, inflight: tuple[concurrent.futures.Future, list, int]) -> int:
        """Await a bucket's broadcasts and every server's reply; the bucket's bytes."""
        reply, works, nbytes = inflight
        for work in works:
            work.wait()
        self._check(reply.result(), "/update_weights_from_distributed")
        return nbytes

    # ------------------------------------------------------------------ probe
    def request_probe(self, input_ids: list[int]) -> concurrent.futures.Future:
        """Start asking every server for its logprobs of ``input_ids`` (a background thread),
        so that the servers compute while the trainer computes its own; the future's result
        is what :meth:`probe` takes as ``server_logprobs``."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probe")
        future = pool.submit(self.client.prompt_logprobs, list(input_ids))
        pool.shutdown(wait=False)
        return future

    def probe(self, input_ids: list[int], trainer_logprobs: torch.Tensor,
              server_logprobs: list[list[float]] | None = None) -> float:
        """Max |server - trainer| logprob of tokens 1..L-1 of ``input_ids`` over all servers
        (asked now, or answered already: ``server_logprobs``, from :meth:`request_probe`).

        Not collective: call it where ``trainer_logprobs`` live (the last PP stage), e.g.
        with :func:`~megatron_klear.rollout.transport.probe.trainer_sequence_logprobs`.
        """
        ref = trainer_logprobs.detach().double().flatten().cpu()
        diffs = []
        if server_logprobs is None:
            server_logprobs = self.client.prompt_logprobs(list(input_ids))
        for lps in server_logprobs:
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


def _flat_range(views: list[torch.Tensor], bucket: Bucket) -> torch.Tensor:
    """The bytes of a run of adjacent views (memory order) as one uint8 tensor sharing their
    storage; checks that each spec's offset is its view's place in it."""
    first = views[0]
    flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), first.data_ptr() - first.untyped_storage().data_ptr(),
        (bucket.nbytes,))
    for spec, view in zip(bucket.specs, views):
        if view.data_ptr() - flat.data_ptr() != spec.offset:
            raise AssertionError(f"{spec.name}: at byte {view.data_ptr() - flat.data_ptr()} "
                                 f"of its run, planned at {spec.offset}")
    return flat


def stage_master_addr(master_addr: str | None, server_url: str, pp: int) -> str:
    """Where this stage's source rank hosts its update group's store: ``master_addr``
    (``--weight-sync-master-addr``) when this node can bind it, else this node's address on
    the route to the first server. With PP > 1 each stage hosts its own group, and the
    stages' source ranks may sit on different nodes: one address cannot serve them all."""
    if master_addr is None:
        return routable_address(server_url)
    if pp > 1 and not is_local_address(master_addr):
        mine = routable_address(server_url)
        log.info("--weight-sync-master-addr %s is not on this node: this pipeline stage hosts "
                 "its weight-update group at %s", master_addr, mine)
        return mine
    return master_addr


def rank_layout(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Rank offsets and world size of the update group: the trainer is rank 0, server i's TP
    ranks are ``offset_i + tp_rank`` with ``offset_i = 1 + sum(tp_j, j < i)``."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return offsets, 1 + sum(tp_sizes)


def aligned_order(items: list, key: Callable[[Any], int] = lambda nt: nt[1].element_size()
                  ) -> list:
    """``items`` (default: ``(name, tensor)``) largest element size (``key``) first, stable: in
    the flattened buffer every tensor then starts at a multiple of its element size (sizes
    are powers of two)."""
    return sorted(items, key=lambda item: -key(item))


def lowest_cpu_priority() -> None:
    """Run the calling thread at the lowest CPU priority (niceness 19; on Linux niceness is
    per thread). The packer runs so: the next bucket's pack then takes only the CPU that the
    current bucket's transfer threads (gloo's sender, a local server's receiver) leave idle,
    instead of slowing the wire. Raising one's own niceness needs no privilege."""
    with contextlib.suppress(OSError):  # a platform without per-thread niceness: no change
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _agree(error: BaseException | None) -> None:
    """Collective: raise on every rank when any rank failed (the failing rank's own error)."""
    flag = torch.tensor([1.0 if error is not None else 0.0], device=platform.device())
    dist.all_reduce(flag)
    if error is not None:
        if isinstance(error, WeightSyncError):
            raise error
        raise WeightSyncError(f"{type(error).__name__}: {error}") from error
    if float(flag) > 0:
        raise WeightSyncError("weight sync failed on another rank (its log names the cause)")
