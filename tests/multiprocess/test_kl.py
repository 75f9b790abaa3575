"""KL to a frozen reference: estimator hand tables, the reference forward against
transformers' Qwen3 at TP=2 (policy weights put back bit for bit), and an RL run with the
KL term."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_klear.algo.kl import kl_per_token
from tests.dist import run_distributed


def test_estimators_hand_table():
    logp = torch.tensor([-1.0, -2.0, 10.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -20.0], dtype=torch.float64)  # log r = 0.5, -1, 30
    want = {"k1": [0.5, -1.0, 30.0],
            "k2": [0.125, 0.5, 450.0],
            "k3": [math.exp(-0.5) - 0.5, math.e - 2.0, math.exp(-30.0) + 29.0],
            "low_var_kl": [math.exp(-0.5) - 0.5, math.e - 2.0, 10.0]}  # 19 + e^-20 -> 10
    for name, values in want.items():
        got = kl_per_token(logp, ref, name)
        assert got.tolist() == pytest.approx(values, rel=1e-14, abs=0), name
    kl = kl_per_token(logp, ref, "k3")
    (grad,) = torch.autograd.grad(kl.sum(), logp)   # d/dlogp (e^-x - 1 + x) = 1 - e^-x
    assert grad.tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.e,
                                           1 - math.exp(-30.0)], rel=1e-14)
    (grad,) = torch.autograd.grad(kl_per_token(logp, ref, "low_var_kl").sum(), logp)
    assert grad[2] == 0  # clamped: no gradient from a far-off token
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_per_token(logp, ref, "k4")


SEQ = [3, 17, 42, 5, 99, 7, 11, 64, 2, 30]


def _swap(rank, world, hf):
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine, restore_or_init
    from megatron_klear.train.reference import ReferencePolicy
    from megatron_klear.algo.rl_objective import old_logprobs

    arch = qwen3_config_from_hf(load_hf_config(hf))
    cfg = TrainConfig(hf_checkpoint=hf, tensor_model_parallel_size=2, global_batch_size=2)
    engine = build_engine(cfg, arch)
    restore_or_init(engine)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # the policy moves away from the reference
        for chunk in engine.model:
            for p in chunk.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    reference = ReferencePolicy(engine, hf)
    before = [p.detach().clone() for c in engine.model for p in c.parameters()]
    ids = torch.tensor(SEQ)
    mb = {"tokens": ids[None, :-1], "labels": ids[None, 1:],
          "position_ids": torch.arange(len(SEQ) - 1)[None]}
    with reference.swapped_in():
        old_logprobs(engine, [mb], arch.vocab_size, 1.0, key="ref_logprobs", entropy_key=None)
    old_logprobs(engine, [mb], arch.vocab_size, 1.0)
    after = [p.detach() for c in engine.model for p in c.parameters()]
    restored = all(torch.equal(a, b) for a, b in zip(before, after))
    return mb["ref_logprobs"][0].tolist(), mb["old_logprobs"][0].tolist(), restored


def test_reference_forward_tp2_matches_transformers_and_restores_policy(tmp_path):
    from megatron_klear.models.tiny import save_tiny_hf_model
    from tests.rollout_helpers import load_reference, reference_logprobs

    hf = save_tiny_hf_model(tmp_path / "hf", seed=0, std=0.2)
    ref_lp, policy_lp, restored = run_distributed(_swap, 2, str(hf))[0]
    want = reference_logprobs(load_reference(hf)[0], SEQ)
    assert restored  # the policy's weights came back bit for bit
    assert torch.tensor(ref_lp) == pytest.approx(want, abs=2e-5)
    assert (torch.tensor(policy_lp) - want).abs().max() > 1e-2  # the policy did move


def _rl(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


def test_rl_with_kl_term(tmp_path):
    from megatron_klear.models.tiny import save_tiny_hf_model

    hf = save_tiny_hf_model(tmp_path / "hf", seed=0, std=0.2)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                            for i in range(8)))
    args = ["--hf-checkpoint", str(hf), "--prompt-data", str(data),
            "--reward", "tests.reward_plugins:parity_reward", "--rollout-batch-size", "4",
            "--mini-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "8",
            "--rollout-max-response-len", "8", "--lr", "1e-2", "--no-dynamic-sampling",
            "--train-iters", "2", "--seed", "3", "--no-progress-bar", "--kl-coef", "0.5",
            "--kl-estimator", "k3"]
    hist = run_distributed(_rl, 1, args, timeout=400)[0]
    assert abs(hist[0]["train/kl"]) < 1e-9  # step 1 trains the reference itself
    assert hist[1]["train/kl"] > 1e-6 and hist[1]["train/kl_loss"] > 1e-6  # then moves off
    m = hist[1]
    assert m["train/loss"] == pytest.approx(m["train/policy_loss"] + 0.1 * m["train/sft_loss"]
                                            + 0.5 * m["train/kl_loss"], rel=1e-5, abs=1e-7)
    assert hist[1]["time/ref_logprob_s"] > 0


def test_dry_run_plans_the_reference_in_host_memory(monkeypatch, capsys):
    from megatron_klear.config import parse_config
    from megatron_klear.train.dry_run import dry_run
    from megatron_klear.train.rl import RLConfig, memory_workload

    monkeypatch.setenv("WORLD_SIZE", "8")
    base = ["--config", "examples/klear_8b/rl_math.yaml", "--hf-checkpoint",
            "examples/klear_8b/hf_config", "--prompt-data", "x.jsonl"]
    plain = parse_config(RLConfig, base)
    with_kl = parse_config(RLConfig, base + ["--kl-coef", "0.001"])
    for cfg in (plain, with_kl):
        cfg.derive()  # preflight's, without the model
    report = dry_run(with_kl, memory_workload(with_kl))["memory"]
    params_gib = report["gib"]["params"]  # the binding stage's weights on the GPU
    assert report["kl_reference_host_gib_per_rank"] == pytest.approx(2 * params_gib, abs=0.02)
    assert "kl_reference_host_gib_per_rank" not in dry_run(plain, memory_workload(plain))["memory"]
    capsys.readouterr()
