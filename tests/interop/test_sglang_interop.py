"""Conformance against real SGLang 0.5.23 on CPU: generation, klear-rl weight sync, faults.

Three real SGLang servers (tiny Qwen3, fp32) start once for the module; every numeric check
compares with transformers (tests/rollout_helpers.py) or with the trainer's own log-probs
(the weight-sync probe). Each defect of issue 12 fails one of these tests when reintroduced:
the update group's store keys (no group forms), rank offsets (ranks collide with a TP=2
server), stage ordering (PP=2 with two servers), per-sample seeds (identical samples).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed
from tests.interop.conftest import start_sglang
from tests.rollout_helpers import load_reference, reference_logprobs

PROBE_TOL = 1e-3


@pytest.fixture(scope="module")
def servers(sglang_model, tmp_path_factory):
    """Servers A, B (kept) and V (the victim of the kill -9 test, which runs last)."""
    with start_sglang(sglang_model, 3, tmp_path_factory.mktemp("sglang_logs")) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"Say something about {i}.", "answer": "x"} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rl_args(hf: Path, data: Path, save: Path, urls: list[str], iters: int, *extra: str):
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(data), "--save", str(save),
            "--reward", "tests.reward_plugins:parity_reward", "--rollout-batch-size", "4",
            "--mini-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
            "--rollout-max-response-len", "12", "--lr", "1e-3", "--no-dynamic-sampling",
            "--train-iters", str(iters), "--seed", "3", "--no-progress-bar",
            "--probe-interval", "1",
            "--rollout-urls", *urls, *extra]


def _rl_train(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


def _check_run(hist: list[dict], iters: int) -> None:
    assert len(hist) == iters
    for m in hist:  # the servers hold the trainer's weights after every sync
        assert m["weight_sync/probe_max_abs_diff"] < PROBE_TOL, m
    means = [m["weight_sync/probe_logprob_mean"] for m in hist]
    assert all(abs(a - b) > 1e-6 for a, b in zip(means, means[1:]))  # the weights moved


def test_generate_logprobs_match_transformers(servers, sglang_model):
    model, tok = load_reference(sglang_model)
    client = RolloutClient(servers.urls[:1], request_timeout_s=120)
    prompt = tok.encode("What is 2+3?")
    gen = client.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0))[0][0]
    assert gen.finish_reason in ("stop", "length") and len(gen.output_ids) == len(gen.logprobs)
    want = reference_logprobs(model, prompt + gen.output_ids)[len(prompt) - 1:]
    torch.testing.assert_close(torch.tensor(gen.logprobs), want.float(), atol=1e-3, rtol=0)
    got = torch.tensor(client.prompt_logprobs(prompt + gen.output_ids)[0])
    torch.testing.assert_close(got, reference_logprobs(model, prompt + gen.output_ids).float(),
                               atol=1e-3, rtol=0)


def test_n_samples_distinct_with_seeds(servers, sglang_model):
    """Seeded prompts: each of the n samples is its own request (its own seed) -> distinct."""
    client = RolloutClient(servers.urls[:2], request_timeout_s=120)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=4)
    gens = client.generate([[5, 6, 7, 8], [9, 10]], params, seeds=[11, 12])
    for group in gens:
        assert len(group) == 4
        assert len({tuple(g.output_ids) for g in group}) >= 3, [g.output_ids for g in group]


def test_buckets_from_parameter_memory_load_into_real_sglang(servers, sglang_model):
    """The recipes' layout (DDP with the distributed optimizer, DP=2), every run of adjacent
    parameters sent from param_data (specs in memory order): real SGLang's
    FlattenedTensorBucket accepts the buckets and serves the trainer's logprobs, also after
    an in-place update (tests/multiprocess/test_weight_sync.py's check, against real SGLang)."""
    from tests.multiprocess.test_weight_sync import STALE_MIN, _sync_and_probe

    results = run_distributed(_sync_and_probe, 2, servers.urls[0], str(sglang_model), 1, 1,
                              "flattened_bucket", True, timeout=600)
    diffs = {k: v for r in results for k, v in r["diffs"].items()}
    assert diffs["before_sync"] > STALE_MIN and diffs["after_step_stale"] > STALE_MIN, diffs
    assert diffs["after_sync"] < PROBE_TOL and diffs["after_step_synced"] < PROBE_TOL, diffs
    assert results[0]["planned"]["direct"] >= 2, results[0]["planned"]


# a trainer at TP=1 (world 1): test_server_with_tp_size_2's run, against a TP=1 and a TP=2 server
@pytest.mark.parametrize("world, layout, n_urls", [
    (2, ["--tensor-model-parallel-size", "2"], 2),
    (2, ["--pipeline-model-parallel-size", "2"], 2),
], ids=["trainer_tp2", "trainer_pp2_two_servers"])
def test_klear_rl_syncs_real_sglang(servers, sglang_model, prompts, tmp_path, world, layout,
                                    n_urls):
    args = _rl_args(sglang_model, prompts, tmp_path / "ck", servers.urls[:n_urls], 2, *layout)
    hist = run_distributed(_rl_train, world, args, timeout=600)[0]
    _check_run(hist, 2)


def test_tensor_handles_and_release_resume_on_real_sglang(servers, sglang_model):
    """Colocation's endpoints on SGLang's CPU engine (issue 31), with the trainer's payload
    (tensor_handles.py: CPU tensors shared by handle, SGLang's flattened_bucket pickle).
    Recorded behaviour: release and resume by tag answer 200 with a null body but free
    nothing on a CPU -- without --enable-memory-saver SGLang's adapter is a no-op
    (sglang/srt/utils/torch_memory_saver_adapter.py, _TorchMemorySaverAdapterNoop), and with
    it the server cannot start here (torch_memory_saver is not installed; its wheel links
    libcuda.so.1) -- so the weights are intact after release + resume (on a GPU they would be
    undefined until the update). update_weights_from_tensor maps the trainer's shared
    memory and loads it: the server then serves transformers' log-probs of those weights.
    Outside a begin/end session it is refused with the message the embedded server copies."""
    from tests.rollout_helpers import load_reference, reference_logprobs
    from tests.multiprocess.test_colocate import _flat_payload
    from tests.multiprocess.test_weight_sync import PROBE_IDS, STALE_MIN, _post
    from megatron_klear.rollout.transport.tensor_handles import serialize_bucket

    url = servers.urls[1]
    client = RolloutClient([url], request_timeout_s=120)
    before = torch.tensor(client.prompt_logprobs(PROBE_IDS)[0])
    # any tag name is taken (offload_tags.add; nothing paused), as the embedded server takes it
    assert _post(url, "/release_memory_occupation", {"tags": ["bogus"]}) == (200, None)
    assert _post(url, "/resume_memory_occupation", {"tags": ["bogus"]}) == (200, None)
    for path, tag in [("/release_memory_occupation", "kv_cache"),
                      ("/release_memory_occupation", "weights"),
                      ("/resume_memory_occupation", "weights")]:
        assert _post(url, path, {"tags": [tag]}) == (200, None)
    ref, _ = load_reference(sglang_model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9).add_(0.01)
    flat, specs = _flat_payload({n: p.detach().clone() for n, p in ref.named_parameters()})
    body = {"load_format": "flattened_bucket", "flush_cache": False, "weight_version": "h1"}
    code, reply = _post(url, "/update_weights_from_tensor",
                        dict(body, serialized_named_tensors=[serialize_bucket(flat, specs)]))
    assert code == 400 and "between begin_weight_update() and end_weight_update()" \
        in reply["message"], reply
    assert _post(url, "/begin_weight_update", {})[0] == 200
    code, reply = _post(url, "/update_weights_from_tensor",
                        dict(body, serialized_named_tensors=[serialize_bucket(flat, specs)]))
    assert _post(url, "/end_weight_update", {})[0] == 200
    assert (code, reply["success"]) == (200, True), reply
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}) == (200, None)
    want = reference_logprobs(ref, PROBE_IDS)
    got = torch.tensor(client.prompt_logprobs(PROBE_IDS)[0])
    assert float((got - want).abs().max()) < PROBE_TOL
    assert float((before - want).abs().max()) > STALE_MIN  # the update changed the weights


def test_klear_rl_colocated_on_real_sglang(servers, sglang_model, prompts, tmp_path):
    """klear-rl --colocate (TP=2) against a real SGLang server as ``python -m
    sglang.launch_server`` leaves it (holding weights and KV cache), handed over as
    ``--rollout-engine-memory launched`` -- the one path run_rl_colocate.sh and tests/gpu take
    (issue 51, defect 2: assuming it released ended SGLang at the first resume, KeyError
    'weights'): the trainer releases it before building its model, then every step's
    hand-over (each tag only in the state SGLang accepts) and the tensor-handle sync go to
    SGLang; the probe is below 1e-3. Without --enable-memory-saver: SGLang cannot start
    with it on a CPU (torch_memory_saver links libcuda.so.1)."""
    from tests.multiprocess.test_weight_sync import _post

    url = servers.urls[1]  # held: the test before resumed what it released
    args = _rl_args(sglang_model, prompts, tmp_path / "ck", [url], 2,
                    "--tensor-model-parallel-size", "2", "--colocate",
                    "--rollout-engine-memory", "launched")
    hist = run_distributed(_rl_train, 2, args, timeout=600)[0]
    _check_run(hist, 2)
    assert all(m["colocate/offloaded_bytes"] > 0 for m in hist)
    # the run ends with the KV cache and CUDA graphs released (Colocation.close); the
    # module's later tests generate on this server: a resume of a released tag is SGLang's
    # rule too
    assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == \
        (200, None)


def test_server_with_tp_size_2(sglang_model, prompts, tmp_path, servers):
    """A --tp-size 2 server joins as ranks offset+0 and offset+1 (offsets from /server_info),
    next to a TP=1 server: world 1 + 1 + 2. The trainer runs at TP=1 (world 1): this is also
    klear-rl's TP=1 trainer syncing real SGLang (the server count aside, what
    test_klear_rl_syncs_real_sglang checks at TP=2 and PP=2)."""
    with start_sglang(sglang_model, 1, tmp_path / "logs", tp=2) as tp2:
        info = RolloutClient(tp2.urls).server_info()[tp2.urls[0]]
        assert info["tp_size"] == 2
        urls = [servers.urls[0], tp2.urls[0]]
        hist = run_distributed(_rl_train, 1, _rl_args(sglang_model, prompts, tmp_path / "ck",
                                                      urls, 2), timeout=600)[0]
    _check_run(hist, 2)


def test_server_killed_mid_step_costs_no_prompt(servers, sglang_model, prompts, tmp_path):
    """kill -9 a server whose requests are in flight: they are retried on the other server,
    the next sync goes to the survivor, and every step trains on its full batch."""
    survivor, victim = servers.urls[0], servers.urls[2]
    save = tmp_path / "ck"
    # responses of up to 128 tokens: step 2's rollout lasts long enough (idle, SGLang's CPU
    # engine decodes 12 tokens for 16 samples in ~0.07 s) for the pause below to land in it
    cmd = [sys.executable, "-m", "megatron_klear.train.rl",
           *_rl_args(sglang_model, prompts, save, [survivor, victim], 3,
                     "--rollout-max-response-len", "128")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = save / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and not (
            metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    # step 1 is logged: step 2's rollout starts now; the victim holds its requests in place
    RolloutClient([victim]).post_all("/pause_generation", {"mode": "in_place"})
    time.sleep(3.0)
    os.killpg(servers.procs[2].pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "retrying POST /generate" in out and victim in out, out[-3000:]
    hist = read_metrics(metrics)
    _check_run(hist, 3)
    assert [m["data/consumed_prompts"] for m in hist] == [4, 8, 12]  # no prompt skipped
    assert all(m["rollout/groups_kept"] == 4 for m in hist)  # every batch complete


def _rejoin(rank: int, world: int, model_dir: str, survivor: str, victim: str, log_dir: str):
    """Sync with the victim dead, restart it on its port, sync again (world 1, one process)."""
    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs
    from tests.multiprocess.test_weight_sync import PROBE_IDS, STALE_MIN, _build

    model, arch = _build(model_dir, 1, 1, seed=11)  # weights far from the checkpoint's
    lp = trainer_sequence_logprobs(model, arch, PROBE_IDS)
    sync = WeightSync([survivor, victim], [model], arch, bucket_bytes=64 * 1024)
    out = {}
    try:
        sync.connect()
        sync.sync("a")  # the victim is dead: the survivor alone forms the group
        out["members_dead"] = list(sync.members)
        port = int(victim.rsplit(":", 1)[1])
        with start_sglang(Path(model_dir), 1, Path(log_dir), base_port=port) as restarted:
            assert restarted.urls == [victim]
            fresh = torch.tensor(RolloutClient([victim]).prompt_logprobs(PROBE_IDS)[0])
            out["restarted_before"] = float((fresh.double() - lp.double()).abs().max())
            sync.sync("b")  # the restarted server rejoins and receives the full weights
            out["members_restarted"] = list(sync.members)
            out["probe"] = sync.probe(PROBE_IDS, lp)  # max over both servers
            out["version"] = RolloutClient([victim]).get_all("/get_model_info")[victim][
                "weight_version"]
            assert out["restarted_before"] > STALE_MIN  # the checkpoint's weights, not ours
    finally:
        sync.close()
    return out


def test_restarted_server_rejoins_weight_sync(servers, sglang_model, tmp_path):
    """After a kill -9 (the previous test's, or its own when run alone): a real SGLang server
    restarted on the victim's port rejoins the weight-update group at the next sync (the
    group is re-formed; the survivor's stale group is dropped) and serves the trainer's
    weights."""
    survivor, victim = servers.urls[0], servers.urls[2]
    if RolloutClient([victim]).health()[victim]:  # run without the kill test before it
        os.killpg(servers.procs[2].pid, signal.SIGKILL)
        servers.procs[2].wait(timeout=60)
    assert not RolloutClient([victim]).health()[victim]
    got = run_distributed(_rejoin, 1, str(sglang_model), survivor, victim,
                          str(tmp_path / "logs"), timeout=600)[0]
    assert got["members_dead"] == [survivor]
    assert got["members_restarted"] == [survivor, victim]
    assert got["probe"] < PROBE_TOL, got
    assert got["version"] == "b"
