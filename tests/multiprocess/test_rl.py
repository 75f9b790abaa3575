"""GPPO RL trainer: hand-computed loss on a fixed batch, and real runs with embedded servers."""

import functools
import json
import math
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed
from tests.kill_points import kill_when_logged
from tests.rollout_helpers import fixed_rollout_batch

EPS_L, EPS_H, ALPHA = 0.2, 0.28, 0.1


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(tmp_path_factory.mktemp("rl") / "hf", seed=0, std=0.2)


def _fixed_batch():
    # 0.5: a partially passing code answer, NOT positive
    return fixed_rollout_batch([1.0, 0.5, 0.0, 1.0], seed=0)


def _hand_step(rank, world, hf_dir):
    """The trainer's loss on a fixed batch vs the GPPO table applied to HF log-probs."""
    from dataclasses import replace

    from transformers import Qwen3ForCausalLM

    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.data.microbatches import pad_microbatches
    from megatron_klear.algo.rl_objective import PolicyLossFlags, policy_loss_fn

    batch = _fixed_batch()
    # advantages by hand: group (1, 0.5): mean .75, unbiased std .3536 -> +-0.7071
    want_adv = [0.25 / math.sqrt(0.125), -0.25 / math.sqrt(0.125), -0.5 / math.sqrt(0.5),
                0.5 / math.sqrt(0.5)]
    assert all(abs(a - w) < 1e-4 for a, w in zip(batch.advantages, want_adv))

    cfg = RLConfig(hf_checkpoint=str(hf_dir), prompt_data="unused", tensor_model_parallel_size=world,
                   mini_batch_size=2, rollout_batch_size=2, n_samples_per_prompt=2,
                   micro_batch_size=2)
    arch = qwen3_config_from_hf(load_hf_config(hf_dir))
    engine = build_engine(cfg, arch, with_optimizer=False)
    load_hf_weights(engine.model, arch, SafetensorsReader(hf_dir))
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    mbs = pad_microbatches(batch, list(range(4)), 2, 0, seq_len)

    hf = Qwen3ForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").float()
    g = torch.Generator().manual_seed(1)
    n_tok = sum(len(r) for r in batch.response_ids)
    n_pos = sum(len(r) for r, w in zip(batch.response_ids, batch.rewards) if w >= 1.0)
    # rollout log-probs = old - SHIFT[sample] on the response: sequence ratios exp(SHIFT * n)
    # = e^0.4, e^2.4, e^-0.9, e^0.25 (responses of 4, 6, 3, 5 tokens); mis, cap 2, lower 0.5
    # keeps samples 0 and 3 with those weights and rejects 1 and 2.
    shift = [0.1, 0.4, -0.3, 0.05]
    weights = [math.exp(0.4), 0.0, 0.0, math.exp(0.25)]
    gppo = sft = corrected = 0.0
    clip_low = clip_high = 0
    for k, mb in enumerate(mbs):  # old = HF log-probs shifted by +-0.5 or 0 -> every GPPO case
        with torch.no_grad():
            logits = hf(input_ids=mb["tokens"]).logits
        logp = torch.log_softmax(logits, -1).gather(-1, mb["labels"][..., None])[..., 0]
        delta = (torch.randint(0, 3, logp.shape, generator=g) - 1) * 0.5
        mb["old_logprobs"] = logp + delta
        mb["entropy"] = torch.zeros_like(logp)   # ERC: rho = (H + 1e-8) / 1e-8, masks all
        rows = torch.tensor(shift[2 * k:2 * k + 2])[:, None]
        mb["rollout_logprobs"] = mb["old_logprobs"] - rows * mb["loss_mask"]
        ratio = torch.exp(-delta)
        adv, mask = mb["advantages"], mb["loss_mask"]
        low = (adv < 0) & (ratio < 1 - EPS_L)
        high = (adv > 0) & (ratio > 1 + EPS_H)
        per_tok = torch.where(low, -(1 - EPS_L) * adv, torch.where(high, -(1 + EPS_H) * adv,
                                                                    -ratio * adv))
        gppo += float((per_tok * mask).sum()) / n_tok
        w = torch.tensor(weights[2 * k:2 * k + 2])[:, None]
        corrected += float((per_tok * mask * w).sum()) / n_tok
        sft += float((-logp * mask * mb["positive"]).sum()) / n_pos
        clip_low += int((low & (mask > 0)).sum())
        clip_high += int((high & (mask > 0)).sum())
    assert clip_low > 0 and clip_high > 0
    stored = engine.forward_only(mbs, policy_loss_fn(cfg.part(PolicyLossFlags), arch.vocab_size,
                                                     n_tok, n_pos, backend=cfg.loss_backend))
    cfg_corr = replace(cfg, rollout_correction="mis", rollout_correction_level="sequence",
                       rollout_correction_lower=0.5, entropy_ratio_clip=0.05)
    stored_corr = engine.forward_only(mbs, policy_loss_fn(cfg_corr.part(PolicyLossFlags),
                                                          arch.vocab_size, n_tok, n_pos,
                                                          backend=cfg.loss_backend))
    if not stored:
        return None
    got = {k: sum(float(m[k]) for m in stored) for k in stored[0]}
    got_corr = {k: sum(float(m[k]) for m in stored_corr) for k in stored_corr[0]}
    return dict(got=got, got_corr=got_corr, n_tok=n_tok,
                want=dict(loss=gppo + ALPHA * sft, policy=gppo, sft=sft, corrected=corrected,
                          clip_low=clip_low / n_tok, clip_high=clip_high / n_tok,
                          weight_mean=sum(w * len(r) for w, r in
                                          zip(weights, batch.response_ids)) / n_tok))


def _two_rank_steps(rank, world, hf_dir):
    """The two-rank launch of this file's fixed-batch checks: the hand-computed step at TP=2,
    then the token-budget step against the padded one (TP=2, then PP=2); each builds its own
    layout and seeds."""
    return {"hand": _hand_step(rank, world, hf_dir),
            "budget": _budget_vs_padded(rank, world, str(hf_dir))}


@pytest.fixture(scope="module")
def two_rank_steps(hf_model):
    return run_distributed(_two_rank_steps, 2, hf_model)


@pytest.mark.parametrize("tp", [1, 2])
def test_loss_and_clip_fractions_match_hand_computation(hf_model, request, tp):
    """At TP=1 (one rank) and TP=2 (the two-rank launch that test_token_budget_step_
    matches_padded_step_tp2_pp2 shares)."""
    ranks = (run_distributed(_hand_step, 1, hf_model) if tp == 1 else
             [r["hand"] for r in request.getfixturevalue("two_rank_steps")])
    r = ranks[-1]
    got, want, n = r["got"], r["want"], r["n_tok"]
    assert abs(got["train/policy_loss"] - want["policy"]) < 1e-5
    assert abs(got["train/sft_loss"] - want["sft"]) < 1e-5
    assert abs(got["train/loss"] - want["loss"]) < 1e-5
    assert abs(got["train/clipfrac_low"] / n - want["clip_low"]) < 1e-6
    assert abs(got["train/clipfrac_high"] / n - want["clip_high"]) < 1e-6
    # rollout correction (mis, sequence level) and ERC through the trainer's loss_fn
    corr = r["got_corr"]
    assert abs(corr["train/policy_loss"] - want["corrected"]) < 1e-5
    assert abs(want["corrected"] - want["policy"]) > 1e-3      # the correction matters here
    assert abs(corr["train/rollout_correction_weight_mean"] / n - want["weight_mean"]) < 1e-5
    assert abs(corr["train/rollout_correction_rejected_frac"] / n - 9 / 18) < 1e-6
    assert abs(corr["train/erc_clipfrac"] / n - 1.0) < 1e-6   # old entropy 0: ERC masks all


def _long_tail_batch(n_groups=4, group=2):
    """Rollout samples of very different lengths (prompts 3-9, responses 1-30 tokens)."""
    from megatron_klear.algo.advantages import group_advantages
    from megatron_klear.samples import RolloutBatch

    g = torch.Generator().manual_seed(5)
    b = RolloutBatch(group_size=group)
    for i in range(n_groups * group):
        if i % group == 0:
            prompt = torch.randint(3, 100, (int(torch.randint(3, 10, (1,), generator=g)),),
                                   generator=g).tolist()
        n = int(torch.randint(1, 31, (1,), generator=g))
        b.prompt_ids.append(prompt)
        b.response_ids.append(torch.randint(3, 100, (n,), generator=g).tolist())
        b.rollout_logprobs.append((-torch.rand(n, generator=g)).tolist())
        b.rewards.append(float(i % 3 == 0))
        b.prompt_index.append(i // group)
        b.truncated.append(False)
    b.advantages = group_advantages(torch.tensor(b.rewards), group).tolist()
    return b


def _budget_vs_padded(rank, world, hf_dir):
    """One mini-batch in token-budget THD packs (old log-probs from its own forward) vs
    padded micro-batches (old log-probs from a separate forward), at TP=2 then PP=2."""
    from dataclasses import replace

    from megatron.core import parallel_state

    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.models import varlen_attention
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.algo.rl_objective import PolicyLossFlags, old_logprobs, policy_loss_fn
    from megatron_klear.data.microbatches import rollout_microbatches

    batch = _long_tail_batch()
    rows = list(range(len(batch)))
    n_tok = sum(len(r) for r in batch.response_ids)
    n_pos = sum(len(r) for r, w in zip(batch.response_ids, batch.rewards) if w >= 1.0)
    arch = qwen3_config_from_hf(load_hf_config(hf_dir))
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        initialize_parallel(tp, pp, seed=0)
        cfg = RLConfig(hf_checkpoint=str(hf_dir), prompt_data="unused",
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       mini_batch_size=4, rollout_batch_size=4, n_samples_per_prompt=2,
                       micro_batch_size=2, max_tokens_per_gpu=48)
        engine = build_engine(cfg, arch, with_optimizer=False)
        load_hf_weights(engine.model, arch, SafetensorsReader(hf_dir))

        def step(run_cfg, precompute_old):
            mbs = rollout_microbatches(batch, rows, run_cfg.micro_batch_layout(), pad_id=0)
            if precompute_old:
                old_logprobs(engine, mbs, arch.vocab_size, run_cfg.rollout_temperature)
            for p in engine.model[0].parameters():
                p.grad = None
            stored = engine.forward_backward(mbs, policy_loss_fn(
                run_cfg.part(PolicyLossFlags), arch.vocab_size, n_tok, n_pos,
                temperature=run_cfg.rollout_temperature, backend=run_cfg.loss_backend))
            grads = {n: p.grad.clone() for n, p in engine.model[0].named_parameters()}
            loss = sum(float(m["train/loss"]) for m in stored) if stored else None
            return mbs, loss, grads

        packs, loss_pack, g_pack = step(cfg, precompute_old=False)
        padded, loss_pad, g_pad = step(replace(cfg, pack_sequences=False,
                                               max_tokens_per_gpu=None), precompute_old=True)
        shared, loss_share, g_share = step(replace(cfg, share_prompts=True), False)
        unshifted = functools.partial(varlen_attention.pack_positions, parents=None)
        with mock.patch.object(varlen_attention, "pack_positions",  # negative control: branches
                               lambda cu, parents: unshifted(cu)):  # restart at position 0
            _, loss_noshift, _ = step(replace(cfg, share_prompts=True), False)
        out[f"tp{tp}pp{pp}"] = dict(
            loss_pack=loss_pack, loss_pad=loss_pad, loss_share=loss_share,
            loss_noshift=loss_noshift,
            grad_diff=max(float((g_pack[n] - g_pad[n]).abs().max()) for n in g_pack),
            share_grad_diff=max(float((g_share[n] - g_pad[n]).abs().max()) for n in g_pack),
            grad_max=max(float(g.abs().max()) for g in g_pad.values()),
            pack_tokens=[int(mb["tokens"].shape[1]) for mb in packs],
            shared_tokens=[int(mb["tokens"].shape[1]) for mb in shared],
            padded_shape=list(padded[0]["tokens"].shape), n_padded=len(padded))
        parallel_state.destroy_model_parallel()
    return out


def test_token_budget_step_matches_padded_step_tp2_pp2(two_rank_steps):
    results = [r["budget"] for r in two_rank_steps]
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert all(t <= 48 for t in r["pack_tokens"]), r  # the budget holds ...
            assert len(set(r["pack_tokens"])) > 1, r  # ... with variable pack lengths
            assert r["n_padded"] == 4 and r["padded_shape"][1] == max(
                len(p) + len(q) for p, q in zip(_long_tail_batch().prompt_ids,
                                                _long_tail_batch().response_ids)) - 1
            assert sum(r["pack_tokens"]) < 8 * r["padded_shape"][1]  # less compute than padding
            assert r["grad_max"] > 1e-2, (rank, layout, r)
            assert r["grad_diff"] < 1e-5, (rank, layout, r)
            # prompt sharing: each prompt once per pack, same loss and gradients
            assert sum(r["shared_tokens"]) < sum(r["pack_tokens"]), r
            assert r["share_grad_diff"] < 1e-5, (rank, layout, r)
            if r["loss_pad"] is not None:
                assert abs(r["loss_pack"] - r["loss_pad"]) < 1e-5, (rank, layout, r)
                assert abs(r["loss_share"] - r["loss_pad"]) < 1e-5, (rank, layout, r)
                # branches that restart at position 0 instead of continuing their prompt
                assert abs(r["loss_noshift"] - r["loss_pad"]) > 1e-4, (rank, layout, r)
    assert results[1]["tp1pp2"]["loss_pad"] is not None


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("rlp") / "prompts.jsonl"
    rows = [{"prompt": f"Say something about {i}.", "answer": "never" if i % 2 else "x"}
            for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rl_args(hf, data, save, iters, *extra):
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(data), "--save", str(save),
            "--reward", "tests.reward_plugins:parity_reward", "--rollout-batch-size", "4",
            "--mini-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
            "--rollout-max-response-len", "12", "--lr", "1e-3",
            "--train-iters", str(iters), "--seed", "3", "--no-progress-bar",
            "--probe-interval", "1", *extra]  # the checks read the probe at every step


def _rl_train(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


# pp2 runs Klear's recipe flags (docs/recipe.md): 8 prompts generated for 4, one round, the
# accuracy filter, the per-micro-batch aggregation, dual clip, an ERC band, left truncation
KLEAR = ["--rollout-gen-batch-size", "8", "--max-gen-rounds", "1", "--filter-groups-metric",
         "acc", "--loss-aggregation", "token-mean-micro", "--dual-clip", "10", "--erc-low", "0.9",
         "--erc-high", "1.2", "--truncate-prompt", "left", "--rollout-max-prompt-len", "16"]


def eval_flags(prompts) -> list[str]:
    """Periodic eval every 2 steps on the training prompts; refilling 4 groups must not hinge
    on luck."""
    return ["--eval-data", str(prompts), "--eval-interval", "2", "--eval-k", "2",
            "--max-sampling-rounds", "8"]


def check_rl_history(hist: list[dict], klear: bool) -> None:
    """A 3-step run with eval_flags(): periodic eval, zero-advantage groups, refill (or
    Klear's one round of 8), optimizer steps, the probe after every sync, moving weights."""
    assert len(hist) == 3
    assert "eval/avg@2" not in hist[0] and hist[1]["eval/problems"] == 12  # periodic eval
    assert 0.0 <= hist[1]["eval/avg@2"] <= hist[1]["eval/pass@2"] <= 0.5  # "never" half is 0
    for step, m in enumerate(hist, 1):
        assert m["rollout/zero_adv_frac"] > 0
        if klear:   # one round of 8, no refill: what is left trains, at most 4 groups
            assert m["rollout/prompts_drawn"] == 8 and m["data/consumed_prompts"] == 8 * step
            assert 0 < m["rollout/groups_kept"] <= 4
            assert m["train/optimizer_steps"] == math.ceil(m["rollout/groups_kept"] / 2)
            continue
        assert m["rollout/groups_kept"] == 4  # refilled to the full batch ...
        assert m["rollout/prompts_drawn"] > 4  # ... past the "never" groups it dropped
        assert m["train/optimizer_steps"] == 2
        assert m["weight_sync/probe_max_abs_diff"] < 1e-4  # server == trainer after sync
    means = [m["weight_sync/probe_logprob_mean"] for m in hist]
    assert all(abs(a - b) > 1e-5 for a, b in zip(means, means[1:]))  # weights moved each step


# the same run at TP=2 (refill, no Klear flags) is the separate run of
# tests/multiprocess/test_colocate.py::test_colocated_rl_equals_separate_rl, checked by check_rl_history
@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2",
                                     "--weight-sync-format", "per_tensor", *KLEAR]],
                         ids=["pp2-klear"])
def test_rl_steps_with_embedded_server(hf_model, prompts, tmp_path, layout):
    args = _rl_args(hf_model, prompts, tmp_path / "ck", 3, *layout, *eval_flags(prompts))
    hist = run_distributed(_rl_train, 2, args, timeout=400)[0]
    check_rl_history(hist, klear=True)
    assert (tmp_path / "ck" / "metrics.jsonl").exists()


def test_killed_run_resumes_bitwise(hf_model, prompts, tmp_path):
    """SIGKILL mid-run, resume: the same losses, rewards and prompts as an uninterrupted run.
    Both probe every 3 steps (--probe-interval 3): after step 1 (the run's first sync), step
    3, and the resumed run's first step, which a probe must not change."""
    from megatron_klear.rollout.transport.probe import PROBE_METRIC

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cli = lambda save: [sys.executable, "-m", "megatron_klear.train.rl",  # noqa: E731
                        *_rl_args(hf_model, prompts, save, 4, "--save-interval", "1",
                                  "--probe-interval", "3")]
    # the uninterrupted reference runs side by side with the run that is killed (independent
    # runs: their imports and model loads overlap)
    ref_log = (tmp_path / "ref.log").open("w")
    ref_run = subprocess.Popen(cli(tmp_path / "ref"), env=env, stdout=ref_log,
                               stderr=subprocess.STDOUT)
    proc = subprocess.Popen(cli(tmp_path / "run"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    # megatron's checkpoint writer (a multiprocessing Manager, started by the saves of steps
    # 1-2) and every other child die with the trainer (checkpoint/state.py)
    kinds = kill_when_logged(proc, metrics, 2)
    assert any("multiprocessing" in k for k in kinds), kinds
    assert ref_run.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ref_log.close()
    killed_lines = len(read_metrics(metrics))
    subprocess.run(cli(tmp_path / "run"), check=True, env=env, capture_output=True)
    ref = {r["step"]: r for r in read_metrics(tmp_path / "ref" / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    assert [PROBE_METRIC in ref[s] for s in (1, 2, 3, 4)] == [True, False, True, False]
    resumed_at = read_metrics(metrics)[killed_lines]["step"]
    for step, r in got.items():
        assert (PROBE_METRIC in r) == (step in (1, 3, resumed_at)), (step, resumed_at)
        assert r.get(PROBE_METRIC, 0.0) < 1e-4
    for step in ref:
        for key in ("train/loss", "train/policy_loss", "rollout/reward_mean",
                    "data/consumed_prompts", "data/prompt_indices"):
            assert got[step][key] == ref[step][key], (step, key)


def _busy(seconds: float) -> None:
    """Spin one core for ``seconds`` (a bounded background load)."""
    end = time.time() + seconds
    while time.time() < end:
        pass


# busy loops beside the loaded run: one, with the trainer's 2 threads and 3 servers, already
# takes turns on a 2-core machine (and the other xdist worker's tests add their own load)
LOAD_PROCESSES = 1
# what a run's timing changes: wall times and rates
TIMING_KEYS = ("time", "weight_sync/seconds", "weight_sync/gbps")


def _timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("time/")
             and not k.endswith("per_s")} for r in rows]


def test_same_run_same_numbers_under_load_delays_and_server_count(hf_model, prompts, tmp_path):
    """--deterministic-rollout --true-on-policy-mode: a 2-step run gives bitwise-equal metrics
    (losses, rewards, rollout log-probs, the probe) run plain on the default servers, and again
    on 3 servers (1 thread each) whose replies are delayed at random (server.REPLY_DELAY_ENV)
    beside a busy core. Without --deterministic-rollout the rollout log-probs
    (train/mismatch_abs_logprob) differ: a batched forward's numbers depend on the batch a
    sequence shares (docs/rollout.md). The weight-sync probe reads exactly 0.0 after each sync
    (without the on-policy mode ~5e-6)."""
    import multiprocessing

    from megatron_klear.rollout.transport.probe import PROBE_METRIC
    from megatron_klear.rollout.engine.server import REPLY_DELAY_ENV

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cli = lambda save, *extra: [sys.executable, "-m", "megatron_klear.train.rl",  # noqa: E731
                                *_rl_args(hf_model, prompts, save, 2, "--deterministic-rollout",
                                          "--true-on-policy-mode", *extra)]
    subprocess.run(cli(tmp_path / "plain"), check=True, env=env, capture_output=True)
    load = [multiprocessing.get_context("fork").Process(target=_busy, args=(120,), daemon=True)
            for _ in range(LOAD_PROCESSES)]
    for p in load:
        p.start()
    try:
        subprocess.run(cli(tmp_path / "loaded", "--rollout-num-servers", "3"), check=True,
                       env=env | {REPLY_DELAY_ENV: "1:0.3"}, capture_output=True)
    finally:
        for p in load:
            p.terminate()
    plain, loaded = (_timeless(read_metrics(tmp_path / d / "metrics.jsonl"))
                     for d in ("plain", "loaded"))
    assert len(plain) == 2 and "train/mismatch_abs_logprob" in plain[0]
    assert loaded == plain
    # --true-on-policy-mode: the servers' log-probs are the trainer's after every sync (TP=1)
    assert [r[PROBE_METRIC] for r in plain] == [0.0, 0.0]


def test_killed_async_run_resumes_exactly(hf_model, prompts, tmp_path):
    """--async-rollout: SIGKILL after step 2 with step 3's batch generated ahead; the resumed
    run trains every prompt of the epoch exactly once (the checkpoint holds the cursor of the
    trained batches, not the prefetch's: saving the prefetch cursor repeats/loses prompts)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "megatron_klear.train.rl",
           *_rl_args(hf_model, prompts, run, 3, "--save-interval", "1", "--async-rollout",
                     "--no-dynamic-sampling", "--no-probe-weights")]
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    kill_when_logged(proc, metrics, 2)
    subprocess.run(cli, check=True, env=env, capture_output=True)
    records = read_metrics(metrics)  # the killed run's lines and the resumed run's
    last = {r["step"]: r for r in records}
    assert sorted(last) == [1, 2, 3]
    assert [last[s]["data/consumed_prompts"] for s in (1, 2, 3)] == [4, 8, 12]
    trained = [i for s in (1, 2, 3) for i in last[s]["data/prompt_indices"]]
    assert sorted(trained) == list(range(12))  # 12 prompts, one epoch: none lost or repeated
    for r in records:  # a step redone after the kill trains the same prompts as before it
        assert r["data/prompt_indices"] == last[r["step"]]["data/prompt_indices"], r["step"]
    staleness = {(r["step"], r["rollout/staleness"]) for r in records}
    assert (1, 0.0) in staleness and all(s <= 1 for _, s in staleness), staleness
    assert any(s == 1 for _, s in staleness), staleness  # batches really were generated ahead


def test_balanced_split_evens_tokens_across_dp_ranks():
    """Hand-computed: longest first, each row to the lighter rank (ties: the lower one). The
    contiguous split of these rows would give 120 vs 35 tokens."""
    from megatron_klear.data.packing import balance

    lengths = [50, 40, 30, 20, 10, 5]
    owner = balance(lengths, 2)
    shares = [[i for i, o in enumerate(owner) if o == r] for r in range(2)]
    assert shares == [[0, 3, 4], [1, 2, 5]]
    assert [sum(lengths[i] for i in s) for s in shares] == [80, 75]
    assert balance([3, 3, 3], 3) == [0, 1, 2]


@pytest.mark.parametrize("bad", [["--transformer-impl", "transformer_engine"],
                                 ["--no-pack-sequences"]])
def test_share_prompts_refused_where_its_tree_mask_cannot_run(bad):
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    base = ["--hf-checkpoint", "hf", "--prompt-data", "p.jsonl", "--share-prompts"]
    assert parse_config(RLConfig, base).share_prompts
    with pytest.raises(ConfigError, match="--share-prompts"):
        parse_config(RLConfig, base + bad)


@pytest.mark.parametrize("flag", ["--deterministic-rollout", "--true-on-policy-mode"])
def test_embedded_server_modes_refused_with_rollout_urls(flag):
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    base = ["--hf-checkpoint", "hf", "--prompt-data", "p.jsonl", flag]
    assert parse_config(RLConfig, base)
    with pytest.raises(ConfigError, match=flag):
        parse_config(RLConfig, base + ["--rollout-urls", "http://127.0.0.1:1"])


def test_probe_interval_names_the_probed_steps():
    """--probe-interval K probes the first sync of a process (a fresh run's step 1, a
    resume's first step) and every K-th step; --no-probe-weights none; K < 1 is refused."""
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    base = ["--hf-checkpoint", "hf", "--prompt-data", "p.jsonl"]
    cfg = parse_config(RLConfig, base)
    assert cfg.probe_interval == 10  # the default
    assert [s for s in range(1, 31) if cfg.probe_due(s, first=s == 1)] == [1, 10, 20, 30]
    assert [s for s in range(7, 21) if cfg.probe_due(s, first=s == 7)] == [7, 10, 20]
    every = parse_config(RLConfig, base + ["--probe-interval", "1"])
    assert all(every.probe_due(s, first=False) for s in range(1, 5))
    off = parse_config(RLConfig, base + ["--no-probe-weights"])
    assert not any(off.probe_due(s, first=s == 1) for s in range(1, 21))
    with pytest.raises(ConfigError, match="--probe-interval"):
        parse_config(RLConfig, base + ["--probe-interval", "0"])


def test_tools_with_a_raw_prompt_template_refused_at_parse_time():
    """--tools renders calls and responses through the chat template: klear-rl refuses
    --prompt-template raw with it when the flags are parsed, with klear-eval's message."""
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.rollout.orchestration.tool_flags import RAW_WITH_TOOLS
    from megatron_klear.train.rl import RLConfig

    base = ["--hf-checkpoint", "hf", "--prompt-data", "p.jsonl", "--tools", "python"]
    assert parse_config(RLConfig, base + ["--prompt-template", "chat"]).tools == ["python"]
    with pytest.raises(ConfigError) as e:
        parse_config(RLConfig, base + ["--prompt-template", "raw"])
    assert str(e.value) == RAW_WITH_TOOLS


def test_rl_with_tools_async_and_dynamic_sampling(tmp_path, prompts):
    """klear-rl --tools python, one launch: multi-turn trajectories (the real sandboxed
    python tool, and hostile calls: malformed JSON, an unknown tool) train under
    --async-rollout (batch 2 generated a step ahead) and dynamic sampling (the "never"
    groups dropped, refilled); the per-turn metrics reach metrics.jsonl and add up, the
    trainer's log-probs at the model's tokens are the engine's (step 1, on-policy: tool
    tokens would differ by whole nats if they were trained), and the periodic eval runs
    with the tools."""
    from megatron_klear.models.tiny import save_tiny_hf_model
    from tests.qwen3_files import qwen3_chat_template_file

    template = qwen3_chat_template_file(tmp_path)
    hf = save_tiny_hf_model(tmp_path / "hf", seed=0, std=0.2, max_position_embeddings=2048)
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(prompts.read_text().splitlines(keepends=True)[:4]))
    cli = [sys.executable, "-m", "megatron_klear.train.rl",
           *_rl_args(hf, prompts, tmp_path / "run", 2, "--chat-template", str(template),
                     "--tools", "python",
                     "--tool-parser", "tests.multiprocess.test_rl:hostile_every_turn",
                     "--max-turns", "3", "--max-tool-response-tokens", "16",
                     "--tool-timeout", "3", "--async-rollout", "--max-sampling-rounds", "8",
                     "--eval-data", str(evals), "--eval-interval", "2", "--eval-k", "2")]
    cli[cli.index("--rollout-max-response-len") + 1] = "200"
    proc = subprocess.run(cli, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hist = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in hist] == [1, 2]
    assert [m["rollout/staleness"] for m in hist] == [0.0, 1.0]     # async: generated ahead
    assert hist[0]["train/mismatch_abs_logprob"] < 1e-4
    for m in hist:
        assert m["rollout/groups_kept"] == 4 and m["rollout/prompts_drawn"] > 4  # refilled
        assert m["rollout/zero_adv_frac"] > 0 and m["train/optimizer_steps"] == 2
        assert m["weight_sync/probe_max_abs_diff"] < 1e-4
        assert m["multi_turn/turns"] > 1 and m["multi_turn/tool_calls"] > 0
        assert m["multi_turn/tool_errors"] > 0 and m["multi_turn/tool_tokens"] > 0
        assert 0 <= m["multi_turn/turn_limit_hits"] <= 1 and m["time/tools_s"] > 0
        assert m["multi_turn/model_tokens"] + m["multi_turn/tool_tokens"] == pytest.approx(
            m["rollout/response_len"])
    assert hist[1]["eval/problems"] == 4 and hist[1]["eval/tool_calls_per_sample"] > 0


def hostile_every_turn(text: str):
    """A tool-call parser by import path for ``klear-rl --tools python``: a random model
    writes no calls, so every turn makes one, picked by the turn's length: a program for
    the real python tool (printing that length), malformed JSON, or an unknown tool (hostile
    calls, answered as errors while the run goes on)."""
    from megatron_klear.rollout.orchestration.tool_calls import parse_hermes

    body = [f'{{"name": "python", "arguments": {{"code": "print({len(text)})"}}}}',
            '{"name": "python", "arguments": ', '{"name": "rm_rf", "arguments": {}}'][
        len(text) % 3]
    return parse_hermes(f"<tool_call>\n{body}\n</tool_call>")


def test_a_run_that_cannot_learn_warns_and_stops(hf_model, tmp_path):
    """Every prompt's reward is 0 (issue 56): every step is skipped; klear-rl warns once after
    WARN_EVERY such steps naming the case and what helps, and --max-skipped-steps WARN_EVERY+1
    stops it before its next step with one line and exit 1 (the real CLI, one process)."""
    from megatron_klear.train.learning_signal import WARN_EVERY

    data = tmp_path / "never.jsonl"   # parity_reward: label "never" is always 0
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "never"}) + "\n"
                            for i in range(8)))
    limit = WARN_EVERY + 1
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_klear.train.rl",
         *_rl_args(hf_model, data, tmp_path / "ck", 20, "--max-sampling-rounds", "1",
                   "--probe-interval", "100", "--max-skipped-steps", str(limit))],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    warnings = [line for line in lines if line.startswith("[rl] warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"[rl] warning: steps 1-{WARN_EVERY} trained nothing: every response failed"), lines
    assert "more or better SFT" in warnings[0]
    assert lines[-1].startswith(f"error: stopped: the last {limit} steps trained nothing "
                                f"(--max-skipped-steps {limit}): every response failed"), lines
    hist = read_metrics(tmp_path / "ck" / "metrics.jsonl")
    assert [m["step"] for m in hist] == list(range(1, limit + 1))
    assert all(m["train/skipped_step"] == 1.0 and m["rollout/zero_adv_frac"] == 1.0
               for m in hist)
