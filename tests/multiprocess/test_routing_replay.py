"""MoE routing replay: the embedded server returns SGLang's routed_experts, and the trainer's
routers replay them (real megatron-core MoE layers, PP=2) where their own top-k would differ."""

from __future__ import annotations

import pytest
import torch

from megatron_klear.rollout.orchestration.client import (RolloutClient, RoutedExpertsMissing,
                                                         SamplingParams)
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from tests.dist import run_distributed

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A tiny Qwen3-MoE, its rollouts with routed experts over real HTTP, and transformers'
    own top-k of every forwarded token (an independent reference)."""
    from transformers import AutoModelForCausalLM

    from megatron_klear.models.tiny import save_tiny_hf_model

    hf = save_tiny_hf_model(tmp_path_factory.mktemp("moe") / "hf", moe=True, std=0.2, seed=0)
    params = SamplingParams(n=2, max_new_tokens=6, return_routed_experts=True)
    with launch_embedded_servers(hf, return_routed_experts=True) as servers:
        gens = [g for group in RolloutClient(servers.urls).generate(PROMPTS, params, [1, 2])
                for g in group]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    cfg = model.config
    seqs, experts, reference = [], [], []
    for prompt, g in zip([p for p in PROMPTS for _ in range(2)], gens):
        seq = prompt + g.output_ids
        seqs.append(seq)
        experts.append(g.routed_experts.view(len(seq) - 1, cfg.num_hidden_layers, -1))
        seen = {}
        hooks = [layer.mlp.gate.register_forward_hook(
            lambda m, i, o, j=j: seen.__setitem__(j, o[2]))
            for j, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        with torch.no_grad():
            model(input_ids=torch.tensor([seq[:-1]]))
        for h in hooks:
            h.remove()
        reference.append(seen)
    return str(hf), seqs, experts, reference


def test_server_returns_transformers_routing(rollout):
    _, seqs, experts, reference = rollout
    for seq, got, seen in zip(seqs, experts, reference):
        assert got.shape[0] == len(seq) - 1  # SGLang's span: every forwarded token
        for layer, ids in seen.items():
            assert torch.equal(got[:, layer].long().sort(-1).values, ids.sort(-1).values)
        dense = [j for j in range(got.shape[1]) if j not in seen]
        assert all(not got[:, j].any() for j in dense)  # zeros, as SGLang's capture buffer


def _replay(rank, world, hf, seqs, experts):
    from megatron.core import parallel_state

    from megatron_klear.config import TrainConfig
    from megatron_klear.data.packing import thd_pack
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.models.routing_replay import routers
    from megatron_klear.train.engine import build_engine, restore_or_init

    arch = qwen3_config_from_hf(load_hf_config(hf))
    cfg = TrainConfig(hf_checkpoint=hf, pipeline_model_parallel_size=2, global_batch_size=2,
                      use_routing_replay=True)
    engine = build_engine(cfg, arch)
    restore_or_init(engine)
    found = routers(engine.model[0])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the trainer's routers drift from the rollout's
        for r in found:
            r.weight.add_(0.5 * torch.randn(r.weight.shape, generator=g))
    used: dict[int, torch.Tensor] = {}
    for r in found:
        r.register_forward_hook(lambda m, i, out: used.__setitem__(
            m.layer_number - 1, out[1].nonzero()[:, 1].view(out[1].shape[0], -1)))
    layers = sorted(r.layer_number - 1 for r in found)
    ranges, start = [], 0
    for s in seqs:
        ranges.append((start, start + len(s) - 1))
        start += len(s) - 1

    def run(with_experts: bool) -> dict[int, torch.Tensor]:
        mb = thd_pack(seqs, {"routed_experts": experts} if with_experts else None)
        used.clear()
        engine.forward_only([mb], lambda logits, b: (logits.new_zeros(()), {}))
        return {k: v.clone() for k, v in used.items()}

    replayed, own = run(True), run(False)
    want = torch.cat(experts)  # [tokens, layers, k] in pack order
    same = all(torch.equal(replayed[j].sort(-1).values, want[:, j].long().sort(-1).values)
               for j in layers)
    differ = sum(int((own[j].sort(-1).values != want[:, j].long().sort(-1).values)
                     .any(-1).sum()) for j in layers)
    return parallel_state.get_pipeline_model_parallel_rank(), layers, same, differ


def test_trainer_replays_rollout_routing_at_pp2(rollout):
    hf, seqs, experts, _ = rollout
    results = run_distributed(_replay, 2, hf, seqs, experts)
    stages = {stage: (layers, same, differ) for stage, layers, same, differ in results}
    assert sorted(stages) == [0, 1]
    assert sorted(stages[0][0] + stages[1][0]) == [0, 2, 3]  # every sparse layer, once
    for layers, same, differ in stages.values():
        assert same  # with replay every router used the rollout's experts
        assert differ > 0  # without it the drifted routers chose others


def _rl(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


def test_rl_step_with_routing_replay(rollout, tmp_path):
    """klear-rl asks the server for routed experts, carries them through packing (shared
    prompts included) and trains with them; the probe and the mismatch stay at fp32 noise."""
    import json

    hf = rollout[0]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                            for i in range(4)))
    args = ["--hf-checkpoint", hf, "--prompt-data", str(data), "--reward",
            "tests.reward_plugins:parity_reward", "--rollout-batch-size", "2",
            "--mini-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
            "--rollout-max-response-len", "6", "--no-dynamic-sampling", "--train-iters", "2", "--probe-interval", "1",
            "--no-progress-bar", "--use-routing-replay", "--share-prompts"]
    hist = run_distributed(_rl, 1, args, timeout=400)[0]
    assert len(hist) == 2
    for m in hist:
        assert m["train/mismatch_abs_logprob"] < 1e-4
        assert m["weight_sync/probe_max_abs_diff"] < 1e-4


def test_replay_against_an_engine_without_experts_stops(rollout, tmp_path):
    """Defect 9 of issue 38: an engine started without --enable-return-routed-experts (as
    SGLang: the request's return_routed_experts is then ignored) returns no experts; a
    klear-rl run with --use-routing-replay against it stops at its first rollout naming the
    flag, instead of training with the trainer's own top-k."""
    import json

    hf = rollout[0]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                            for i in range(4)))
    params = SamplingParams(n=1, max_new_tokens=2, return_routed_experts=True)
    with launch_embedded_servers(hf) as servers:
        assert RolloutClient(servers.urls).server_info()[servers.urls[0]][
            "enable_return_routed_experts"] is False
        with pytest.raises(RoutedExpertsMissing, match="--enable-return-routed-experts"):
            RolloutClient(servers.urls).generate([PROMPTS[0]], params)
        args = ["--hf-checkpoint", hf, "--prompt-data", str(data), "--reward",
                "tests.reward_plugins:parity_reward", "--rollout-batch-size", "2",
                "--mini-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size",
                "4", "--rollout-max-response-len", "4", "--no-dynamic-sampling",
                "--train-iters", "1", "--no-progress-bar", "--use-routing-replay",
                "--rollout-urls", *servers.urls]
        with pytest.raises(AssertionError, match="RoutedExpertsMissing.*--enable-return-rout"):
            run_distributed(_rl, 1, args, timeout=400)


def test_routing_replay_refuses_token_splits():
    from megatron_klear.config import ConfigError, TrainConfig, parse_config

    with pytest.raises(ConfigError, match="--use-routing-replay .*--sequence-parallel"):
        parse_config(TrainConfig, ["--use-routing-replay", "--sequence-parallel",
                                   "--tensor-model-parallel-size", "2"])
