"""Colocated mode (issue 31) on CPU: the embedded server's release/resume and tensor-handle
updates with SGLang's payloads, and the trainer's tensor-handle weight sync.

References: transformers' Qwen3 (tests/rollout_helpers.py) for what a loaded server must
compute; SGLang's own ``MultiprocessingSerializer`` bytes are checked in tests/interop/.
"""

from __future__ import annotations

import pytest
import torch

from megatron_klear.rollout.client import RolloutClient
from megatron_klear.rollout.launcher import launch_embedded_servers
from megatron_klear.rollout.tensor_handles import (bucket_tensors, deserialize, serialize_bucket,
                                                   shared_buffer)
from tests.dist import run_distributed
from tests.rollout_helpers import load_reference, make_tiny_model, reference_logprobs
from tests.test_weight_sync import PROBE_IDS, SYNCED_TOL, _hf_bytes, _post


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _flat_payload(named: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """A shared flattened bucket of ``named`` (fp32, back to back) and its specs."""
    flat = shared_buffer(sum(t.numel() * 4 for t in named.values()), torch.device("cpu"))
    specs, offset = [], 0
    for name, t in named.items():
        n = t.numel() * 4
        flat[offset:offset + n].view(torch.float32).copy_(t.flatten())
        specs.append((name, tuple(t.shape), torch.float32, offset))
        offset += n
    return flat, specs


def test_handle_payload_round_trip_maps_the_senders_memory():
    """The receiver sees the sender's bytes (not a copy): a later write shows through."""
    flat = shared_buffer(24, torch.device("cpu"))
    flat.copy_(torch.arange(24, dtype=torch.uint8))
    named = bucket_tensors(deserialize(serialize_bucket(
        flat, [("a", (2, 2), torch.float32, 0), ("b", (4,), torch.bfloat16, 16)])))
    assert [(n, tuple(t.shape), t.dtype) for n, t in named] == [
        ("a", (2, 2), torch.float32), ("b", (4,), torch.bfloat16)]
    assert torch.equal(named[1][1].view(torch.uint8), torch.arange(16, 24, dtype=torch.uint8))
    flat[16] = 99
    assert named[1][1].view(torch.uint8)[0] == 99
    with pytest.raises(ValueError, match="do not lie aligned"):
        bucket_tensors(deserialize(serialize_bucket(flat, [("c", (2,), torch.float32, 2)])))


def test_release_resume_and_update_from_tensor(model_dir):
    """SGLang's colocation endpoints on the embedded server: release kv_cache then weights,
    generation refused, update refused while weights are released and outside a session,
    resume weights, a handle update of every tensor, resume kv_cache: the server's logprobs
    are transformers' with the new weights."""
    ref, _ = load_reference(model_dir)
    with torch.no_grad():
        for p in ref.parameters():  # new weights the server never loaded from disk
            p.mul_(0.9).add_(0.01)
    named = {n: p.detach().clone() for n, p in ref.named_parameters()}
    flat, specs = _flat_payload(named)
    body = {"load_format": "flattened_bucket", "flush_cache": False, "weight_version": "h1"}

    def payload():
        return dict(body, serialized_named_tensors=[serialize_bucket(flat, specs)])

    with launch_embedded_servers(model_dir, 1) as servers:
        url = servers.urls[0]
        assert _post(url, "/release_memory_occupation", {"tags": ["bogus"]})[0] == 400
        assert _post(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400
        for tag in ("kv_cache", "weights"):
            code, reply = _post(url, "/release_memory_occupation", {"tags": [tag]})
            assert (code, reply) == (200, None)
        code, reply = _post(url, "/generate", {"input_ids": [1, 2]})
        assert code == 400 and "resume_memory_occupation" in reply["error"]["message"]
        assert _post(url, "/begin_weight_update", {})[0] == 200
        code, reply = _post(url, "/update_weights_from_tensor", payload())
        assert code == 400 and "weights are released" in reply["error"]["message"]
        assert _post(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
        code, reply = _post(url, "/update_weights_from_tensor", payload())
        assert (code, reply["success"]) == (200, True), reply
        assert "Weight version updated to h1" in reply["message"]
        assert _post(url, "/end_weight_update", {})[0] == 200
        code, reply = _post(url, "/update_weights_from_tensor", payload())  # no session
        assert code == 400 and "between begin_weight_update() and end_weight_update()" \
            in reply["message"]
        assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        got = RolloutClient([url]).prompt_logprobs(PROBE_IDS)[0]
        torch.testing.assert_close(torch.tensor(got), reference_logprobs(ref, PROBE_IDS),
                                   atol=1e-4, rtol=0)


def test_resumed_weights_are_undefined_until_updated(model_dir):
    """Resumed weights hold NaN (SGLang's are whatever torch_memory_saver maps), so a rollout
    served between resume and update cannot pass for a synced one; the memory is freed."""
    from megatron_klear.rollout.generator import Generator

    gen = Generator(model_dir)
    total = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    assert gen.release_weights() == total
    assert all(p.numel() == 0 for p in gen.model.parameters())
    gen.resume_weights()
    assert all(torch.isnan(p).all() for p in gen.model.parameters())
    with pytest.raises(ValueError, match="unknown parameter 'model.bogus'"):
        gen.load_tensors([("model.bogus", torch.zeros(1))])


def _separate_then_colocated(rank: int, world: int, argv: list[str], root: str) -> dict:
    """The same klear-rl run twice in these ranks: separate mode, then ``--colocate``."""
    from megatron_klear.config import parse_config
    from megatron_klear.train.rl import RLConfig, train

    keys = ("train/loss", "grad_norm", "rollout/reward_mean",
            "weight_sync/probe_logprob_mean", "weight_sync/bytes")
    out = {}
    # --sglang-tp-size 2: one embedded server for the two ranks; the separate run starts its
    # default number (one per core), and rollouts do not depend on the number of servers
    colocated = ["--colocate", "--sglang-tp-size", "2"]
    for mode, extra in (("separate", []), ("colocated", colocated)):
        hist = train(parse_config(RLConfig, argv + extra + ["--save", f"{root}/{mode}"]))
        out[mode] = [{k: m.get(k) for k in keys} for m in hist]
        out[mode + "_all"] = [{k: v for k, v in m.items() if isinstance(v, float)}
                              for m in hist]
    return out


def test_colocated_rl_equals_separate_rl(model_dir, tmp_path):
    """klear-rl --colocate (TP=2, the quickstart's layout) against the embedded server: the
    same losses, grad norms, rewards and probe log-probs as the separate mode, step for step
    (seeded rollouts on the same weights: handles and broadcast deliver the same bytes);
    the probe below 1e-4 after every colocated sync; the trainer offloaded between steps."""
    from tests.test_rl import _rl_args

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Say something about {i}.", "answer": '
                               f'"{"never" if i % 2 else "x"}"}}\n' for i in range(12)))
    argv = _rl_args(model_dir, prompts, tmp_path / "unused", 2, "--tensor-model-parallel-size",
                    "2", "--max-sampling-rounds", "8")
    r = run_distributed(_separate_then_colocated, 2, argv, str(tmp_path), timeout=500)[0]
    assert r["colocated"] == r["separate"]
    means = [m["weight_sync/probe_logprob_mean"] for m in r["colocated"]]
    assert means[0] != means[1]  # the weights moved
    assert r["colocated"][0]["weight_sync/bytes"] == _hf_bytes(model_dir)  # each tensor once
    for m in r["colocated_all"]:
        assert m["weight_sync/probe_max_abs_diff"] < SYNCED_TOL
        assert m["colocate/offloaded_bytes"] > 0
        assert m["time/engine_release_s"] > 0 and m["time/trainer_onload_s"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--async-rollout"], "--async-rollout cannot run with --colocate"),
    (["--weight-sync-format", "per_tensor"], "drop --weight-sync-format per_tensor"),
    (["--rollout-num-servers", "2"], "one engine runs per --sglang-tp-size ranks"),
])
def test_colocate_refuses_what_it_cannot_do(tmp_path, extra, message):
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    base = ["--hf-checkpoint", str(tmp_path), "--prompt-data", "p.jsonl", "--colocate"]
    parse_config(RLConfig, base)  # valid alone
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        parse_config(RLConfig, base + extra)
