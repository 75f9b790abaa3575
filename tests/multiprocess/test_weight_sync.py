"""Weight sync from a real Megatron model (gloo ranks) to a real embedded server process.

The acceptance check: after a sync the server's logprobs of a fixed sequence equal the
trainer's (Megatron, TP-gathered logits) to 1e-4 in fp32, before and after an optimizer step
changed the weights; a server whose sync was skipped is caught by the probe.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.distributed import free_port
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from megatron_klear.rollout.transport.update_group import open_update_group
from megatron_klear.rollout.transport.weight_sync import (aligned_order, iter_buckets, plan_bucket,
                                                          rank_layout)
from tests.dist import run_distributed
from tests.rollout_helpers import load_reference, make_tiny_model, reference_logprobs

PROBE_IDS = [7, 20, 33, 41, 8, 15, 62, 70, 11, 5, 90, 24]
SYNCED_TOL = 1e-4
STALE_MIN = 1e-2  # random re-initialisations differ by whole nats; 1e-2 is far above noise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with launch_embedded_servers(model_dir, 1, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def _build(model_dir: str, tp: int, pp: int, seed: int, dist_opt: bool = False):
    """The megatron model; ``dist_opt``: as the recipes build it (engine.build_model, DDP with
    the distributed optimizer: every parameter a view of one param_data buffer)."""
    from megatron_klear.config import TrainConfig
    from megatron_klear.models import qwen3
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_model

    initialize_parallel(tp=tp, pp=pp, seed=seed)
    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(model_dir))
    if dist_opt:
        model = build_model(arch, TrainConfig(tensor_model_parallel_size=tp,
                                              pipeline_model_parallel_size=pp,
                                              use_distributed_optimizer=True))[0]
    else:
        model = qwen3.build_gpt_model(arch, qwen3.transformer_config(arch, tp=tp, pp=pp))
    with torch.no_grad():  # large weights: a wrong mapping moves logprobs by whole nats
        for p in model.parameters():
            p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0.0, 0.2)
    return model, arch


def _optimizer_step(model, arch) -> None:
    """One Adam step on the vocab-parallel cross entropy (identical loss on all TP ranks)."""
    from megatron.core import tensor_parallel

    ids = torch.tensor([PROBE_IDS])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    logits = model(ids, torch.arange(ids.shape[1])[None], attention_mask=None)
    labels = torch.roll(ids, -1, dims=1)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
    loss.backward()
    opt.step()


def _in_place_step(model) -> None:
    """What megatron's DistributedOptimizer does to the model at the end of a step: write the
    updated values into the parameters, which are views of DDP's param_data
    (megatron/core/optimizer/distrib_optimizer.py, _copy_main_params_to_model_params)."""
    gen = torch.Generator().manual_seed(7)  # the same update on every DP replica
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def _check_direct_buckets(sync, model, arch) -> dict:
    """The source rank's buckets sent from parameter memory: each lies inside DDP's param_data
    and each named slice of it equals the HF export (hf_bridge.export_hf_weights, copies)."""
    from megatron_klear.checkpoint.hf_bridge import export_hf_weights

    ref = dict(export_hf_weights([model], arch))
    data = model.buffers[0].param_data
    lo, hi = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
    direct, names = 0, []
    for bucket, _, flat in sync._placed[1]:
        names += [t.name for t in bucket.specs]
        if flat is None:
            continue
        direct += 1
        assert lo <= flat.data_ptr() and flat.data_ptr() + bucket.nbytes <= hi
        for t in bucket.specs:
            got = flat[t.offset:t.offset + ref[t.name].numel() * t.dtype.itemsize]
            assert torch.equal(got.view(t.dtype).view(t.shape), ref[t.name]), t.name
    assert sorted(names) == sorted(ref)  # every tensor sent once
    return {"direct": direct, "buckets": len(sync._placed[1])}


def _sync_and_probe(rank: int, world: int, url: str, model_dir: str, tp: int, pp: int,
                    load_format: str | None, dist_opt: bool = False):
    """Per rank: probe (stale) -> sync v1 -> probe -> [optimizer step -> probe (stale) ->
    sync v2 -> probe]. Returns the probe diffs measured on the last stage, and metrics;
    ``dist_opt``: the recipes' layout, every adjacent run sent from parameter memory."""
    from megatron.core import parallel_state as ps

    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs

    model, arch = _build(model_dir, tp, pp, seed=1000 + 10 * tp + pp, dist_opt=dist_opt)
    sync = WeightSync([url], [model], arch, bucket_bytes=32 * 1024, load_format=load_format,
                      min_direct_bytes=1 if dist_opt else 2**40)
    sync.connect()
    planned = {}
    diffs, metrics = {}, []

    def probe(tag: str) -> None:
        lp = trainer_sequence_logprobs(model, arch, PROBE_IDS)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            diffs[tag] = sync.probe(PROBE_IDS, lp)

    probe("before_sync")
    metrics.append(sync.sync("v1"))
    probe("after_sync")
    if pp == 1:
        _in_place_step(model) if dist_opt else _optimizer_step(model, arch)
        probe("after_step_stale")
        metrics.append(sync.sync("v2"))
        probe("after_step_synced")
        if dist_opt and sync.is_source:
            planned = _check_direct_buckets(sync, model, arch)
    sync.close()
    return {"diffs": diffs, "metrics": metrics, "planned": planned}


def _hf_bytes(model_dir) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * 4 for k in f.keys())


SYNC_LAYOUTS = [(2, 1, "flattened_bucket", False), (1, 2, None, False),
                (1, 1, "flattened_bucket", True)]  # (tp, pp, load_format, dist_opt)


def _sync_each_layout(rank: int, world: int, url: str, model_dir: str) -> list[dict]:
    """_sync_and_probe for every layout of SYNC_LAYOUTS in turn, in the same two ranks (one
    launch for all); rank 0's results hold the weight version the server reports after it."""
    from megatron.core import parallel_state

    out = []
    for layout in SYNC_LAYOUTS:
        out.append(_sync_and_probe(rank, world, url, model_dir, *layout))
        parallel_state.destroy_model_parallel()
        if rank == 0:
            gen = RolloutClient([url]).generate(["a"], SamplingParams(max_new_tokens=1))[0][0]
            out[-1]["server_version"] = gen.weight_version
    return out


@pytest.fixture(scope="module")
def synced(server, model_dir) -> dict[tuple, list[dict]]:
    """Per layout of SYNC_LAYOUTS, the per-rank results of _sync_each_layout."""
    ranks = run_distributed(_sync_each_layout, 2, server.urls[0], str(model_dir), timeout=600)
    return {layout: [r[i] for r in ranks] for i, layout in enumerate(SYNC_LAYOUTS)}


@pytest.mark.parametrize("tp, pp, load_format, dist_opt", SYNC_LAYOUTS)
def test_sync_makes_server_match_trainer(synced, model_dir, tp, pp, load_format, dist_opt):
    """dist_opt: DDP with the distributed optimizer at DP=2 (the recipes' layout); adjacent
    parameters are sent from their own memory, the rest packed."""
    results = synced[(tp, pp, load_format, dist_opt)]
    diffs = {k: v for r in results for k, v in r["diffs"].items()}
    assert diffs["before_sync"] > STALE_MIN, diffs
    assert diffs["after_sync"] < SYNCED_TOL, diffs
    if pp == 1:
        assert diffs["after_step_stale"] > STALE_MIN, diffs
        assert diffs["after_step_synced"] < SYNCED_TOL, diffs
    for m in results[0]["metrics"]:
        assert m["weight_sync/bytes"] == _hf_bytes(model_dir)
        assert m["weight_sync/seconds"] > 0 and m["weight_sync/gbps"] > 0
    if dist_opt:  # one run per layer and the embedding's, the q/k/v packed
        planned = results[0]["planned"]
        assert planned["direct"] >= 2 and planned["buckets"] > planned["direct"], planned
    version = "v2" if pp == 1 else "v1"
    assert results[0]["server_version"] == version


def test_iter_buckets_respects_size_and_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([3, 5, 2, 9, 1])]
    buckets = list(iter_buckets(named, bucket_bytes=32))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    buckets = list(iter_buckets(named, bucket_bytes=32, first_bucket_bytes=12))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4"]]
    # the plan: bf16 "a" first in export order, but fp32 "b" first on the wire (aligned)
    plan = plan_bucket([("a", (3,), torch.bfloat16), ("b", (1, 2), torch.float32)], True, "g")
    assert [(t.name, t.offset) for t in plan.specs] == [("a", 8), ("b", 0)]
    assert plan.nbytes == 6 + 8 and plan.payload["names"] == ["b", "a"]
    assert plan.payload["shapes"] == [[1, 2], [3]]
    assert plan.payload["dtypes"] == ["float32", "bfloat16"]
    per_tensor = plan_bucket([("a", (3,), torch.bfloat16), ("b", (1, 2), torch.float32)],
                             False, "g")
    assert per_tensor.payload["names"] == ["a", "b"] and per_tensor.payload["load_format"] is None


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(url + path, json=body) as resp:
                return resp.status, await resp.json()
    return asyncio.run(go())


def test_per_tensor_update_and_wrong_name(model_dir, tmp_path):
    """Per-tensor load_format: a new final norm changes logprobs exactly as in transformers;
    a wrong tensor name is received, then refused with 400 naming it (no hang)."""
    model, _ = load_reference(model_dir)
    new_norm = torch.linspace(0.5, 1.5, model.config.hidden_size)
    with torch.no_grad():
        model.model.norm.weight.copy_(new_norm)
    with launch_embedded_servers(model_dir, 1) as servers:
        url, port = servers.urls[0], free_port()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(_post, url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": "g", "backend": "gloo"})
            group = open_update_group("127.0.0.1", port, 0, 2, "g", "gloo", 60)
            assert joined.result()[0] == 200
            assert _post(url, "/begin_weight_update", {})[0] == 200
            code, body = _post(url, "/begin_weight_update", {})  # one session at a time
            assert code == 400 and body["success"] is False and "already open" in body["message"]
            code, body = _post(url, "/update_weights_from_distributed", {  # refused unjoined
                "names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["bfloat16",
                                                                             "float32"],
                "shapes": [[3], [4]], "group_name": "g", "load_format": "flattened_bucket"})
            assert code == 400 and "Unaligned received tensor lm_head.weight" in str(body)
            for name, expect in [("model.norm.weight", 200), ("model.bogus.weight", 400)]:
                reply = pool.submit(_post, url, "/update_weights_from_distributed", {
                    "names": [name], "dtypes": ["float32"], "shapes": [[new_norm.numel()]],
                    "group_name": "g", "weight_version": "w1"})
                group.broadcast(new_norm.clone())
                code, body = reply.result()
                assert code == expect, body
            assert "model.bogus.weight" in body["message"]
            assert _post(url, "/end_weight_update", {})[0] == 200
            assert _post(url, "/destroy_weights_update_group", {"group_name": "g"})[0] == 200
            group.close()
        ids = PROBE_IDS
        got = RolloutClient(servers.urls).prompt_logprobs(ids)[0]
        torch.testing.assert_close(torch.tensor(got), reference_logprobs(model, ids),
                                   atol=1e-4, rtol=0)


def test_bucket_order_is_aligned_and_rank_layout_is_cumulative():
    bucket = [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2)),
              ("c", torch.zeros(1, dtype=torch.uint8)), ("d", torch.zeros(5, dtype=torch.float16)),
              ("e", torch.zeros(1, dtype=torch.float64))]
    ordered = aligned_order(bucket)
    offset = 0
    for _, t in ordered:  # SGLang's FlattenedTensorBucket rule: offset % itemsize == 0
        assert offset % t.element_size() == 0, [n for n, _ in ordered]
        offset += t.numel() * t.element_size()
    assert [n for n, _ in ordered] == ["e", "b", "a", "d", "c"]  # stable within a dtype size
    assert rank_layout([1]) == ([1], 2)
    assert rank_layout([2, 1, 4]) == ([1, 3, 4], 8)  # no two servers' TP ranks collide


def _faults(rank: int, world: int, model_dir: str, urls: list[str], log_dir: str):
    """A sync failing halfway, then a server killed and restarted (world 1, one process)."""
    import os
    import signal

    from megatron_klear.rollout.transport.weight_sync import WeightSync, WeightSyncError
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs

    model, arch = _build(model_dir, 1, 1, seed=7)

    class FailingExport(WeightSync):
        def _export(self):
            for i, item in enumerate(super()._export()):
                if i == 3:
                    raise RuntimeError("export exploded")
                yield item

    out = {}
    sync = FailingExport(urls, [model], arch, bucket_bytes=4 * 1024)
    sync.connect()
    try:
        sync.sync("broken")
    except WeightSyncError as exc:
        out["error"] = str(exc)
    out["paused_after_failure"] = _serving(urls)
    out["begin_after_failure"] = [_post(u, "/begin_weight_update", {})[0] for u in urls]
    out["end_after_failure"] = [_post(u, "/end_weight_update", {})[0] for u in urls]
    sync.close()

    sync = WeightSync(urls, [model], arch, bucket_bytes=4 * 1024)
    sync.connect()
    sync.sync("v1")
    victim = int(os.environ["VICTIM_PGID"])
    os.killpg(victim, signal.SIGKILL)
    sync.sync("v2")  # the dead server left the group; the survivor still syncs
    out["members_after_kill"] = list(sync.members)
    port = int(urls[1].rsplit(":", 1)[1])
    with launch_embedded_servers(model_dir, 1, base_port=port, log_dir=log_dir):
        sync.sync("v3")  # the restarted server rejoins and receives the full weights
        out["members_after_restart"] = list(sync.members)
        lp = trainer_sequence_logprobs(model, arch, PROBE_IDS)
        out["probe_after_restart"] = sync.probe(PROBE_IDS, lp)
        out["versions"] = [RolloutClient([u]).get_all("/get_weight_version")[u]["weight_version"]
                           for u in urls]
        sync.close()
    return out


def _serving(urls: list[str]) -> bool:
    """Every server answers a 1-token /generate within 20 s (none left paused)."""
    client = RolloutClient(urls, request_timeout_s=20, max_retries=0)
    return all(len(client.generate([[5, 6]], SamplingParams(max_new_tokens=1))[0]) == 1
               for _ in urls)


def test_sync_failure_resumes_servers_and_restarted_server_rejoins(model_dir, tmp_path,
                                                                  monkeypatch):
    with launch_embedded_servers(model_dir, 2, log_dir=tmp_path) as servers:
        monkeypatch.setenv("VICTIM_PGID", str(servers.procs[1].pid))
        got = run_distributed(_faults, 1, str(model_dir), servers.urls, str(tmp_path / "re"),
                              timeout=300)[0]
    assert "export exploded" in got["error"] and "rerun" in got["error"], got
    assert got["paused_after_failure"] is True  # continue_generation ran in the finally
    assert got["begin_after_failure"] == [200, 200]  # end_weight_update ran: no open session
    assert got["end_after_failure"] == [200, 200]
    assert got["members_after_kill"] == servers.urls[:1]
    assert got["members_after_restart"] == servers.urls
    assert got["probe_after_restart"] < SYNCED_TOL  # both servers hold the trainer's weights
    assert got["versions"] == ["v3", "v3"]


def test_embedded_server_receives_flat_buckets_without_copies(model_dir):
    """Parameters become views of the received bucket; the next bucket goes into the other
    pooled buffer (never the one backing the live parameters); the third reuses the first."""
    from megatron_klear.rollout.engine.generator import Generator

    gen = Generator(model_dir)
    names = ["model.norm.weight", "model.layers.0.self_attn.k_proj.weight"]
    specs = [(n, torch.float32, tuple(gen.params[n].shape)) for n in names]
    storage = []
    for value in (1.0, 2.0, 3.0):
        sent = torch.cat([torch.full(s, value).flatten() for _, _, s in specs])
        with gen.receiving(specs, flattened=True) as (buf,):  # what the broadcast fills in
            buf.copy_(sent.view(torch.uint8))
        assert all(torch.all(gen.params[n] == value) for n in names)
        ptrs = {gen.params[n].untyped_storage().data_ptr() for n in names}
        assert len(ptrs) == 1  # both are views of one received buffer: nothing copied
        storage.append(ptrs.pop())
        if value == 2.0:  # the first buffer was not received into while it backed params
            old = gen._recv_pool[names[0]][0][0]  # [buffer, names]
            assert old.untyped_storage().data_ptr() == storage[0]
            assert torch.all(old[:4].view(torch.float32) == 1.0)
    assert storage[0] != storage[1] and storage[2] == storage[0]
    assert len(gen._recv_pool[names[0]]) == 2
    # the plan changes: names[1] alone (a bucket of its own), then both again; names[0] still
    # backs onto storage[2], which the next receive of both must not overwrite
    for group, value in ((specs[1:], 4.0), (specs, 5.0)):
        with gen.receiving(group, flattened=True) as (buf,):
            buf.copy_(torch.cat([torch.full(s, value).flatten() for _, _, s in group])
                      .view(torch.uint8))
        assert torch.all(gen.params[names[1]] == value)
        assert torch.all(gen.params[names[0]] == (3.0 if value == 4.0 else 5.0))
    assert gen.params[names[0]].untyped_storage().data_ptr() == storage[1]


def test_packer_thread_runs_at_lowest_cpu_priority():
    """The pack of the next bucket must yield the CPU to the transfer (the bench's 0.90 rests
    on it); the calling thread and other threads keep their priority."""
    import concurrent.futures
    import os
    import threading

    from megatron_klear.rollout.transport.weight_sync import lowest_cpu_priority

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = niceness()
    with concurrent.futures.ThreadPoolExecutor(1, initializer=lowest_cpu_priority) as packer:
        assert packer.submit(niceness).result() == 19
    assert niceness() == before


def test_update_backend_follows_the_servers_devices(monkeypatch):
    """NCCL only from a GPU trainer to GPU servers (NCCL moves CUDA tensors only); a CPU
    server anywhere (the embedded one reports device cpu in /server_info) means gloo."""
    from megatron_klear import platform
    from megatron_klear.rollout.transport.weight_sync import update_backend

    assert update_backend(["cuda"]) == "gloo"  # this CPU trainer
    monkeypatch.setattr(platform, "device", lambda: torch.device("cuda", 0))
    assert update_backend(["cuda", "cuda"]) == "nccl"
    assert update_backend(["cuda", "cpu"]) == "gloo"
    assert update_backend(["cpu"]) == "gloo"


def test_each_pipeline_stage_hosts_its_group_on_its_own_node():
    """--weight-sync-master-addr names one node; with PP > 1 a stage on another node (whose
    address it cannot bind) hosts its group at its own address on the route to the servers."""
    from megatron_klear.rollout.transport.weight_sync import stage_master_addr

    url = "http://127.0.0.1:30000"
    other_node = "10.255.255.1"  # not an address of this machine
    assert stage_master_addr(None, url, 2) == "127.0.0.1"
    assert stage_master_addr("127.0.0.1", url, 2) == "127.0.0.1"
    assert stage_master_addr(other_node, url, 2) == "127.0.0.1"
    assert stage_master_addr(other_node, url, 1) == other_node  # PP 1: the user's choice
