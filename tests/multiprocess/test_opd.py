"""On-policy distillation (issue 54): the served teacher's per-token log-probs, the trainer's
advantage against a hand computation from transformers, a real ``klear-rl --use-opd`` run,
and the up-front checks (exit 2 with one line, dry run and real run alike).

The teacher is an embedded server over a tiny Qwen3 of another size (3 layers, a wider MLP)
with the student's tokenizer; a second one has a tokenizer with one more token.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed
from tests.rollout_helpers import fixed_rollout_batch, load_reference, reference_logprobs

LAMBDA = 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Student, teacher (same tokenizer, other size), and a teacher whose tokenizer differs."""
    from megatron_klear.models.tiny import build_tokenizer, save_tiny_hf_model

    d = tmp_path_factory.mktemp("opd")
    student = save_tiny_hf_model(d / "student", seed=0, std=0.2)
    teacher = save_tiny_hf_model(d / "teacher", seed=7, std=0.2, num_hidden_layers=3,
                                 intermediate_size=192)
    other = save_tiny_hf_model(d / "other", seed=7, std=0.2, with_tokenizer=False)
    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(other))
    return {"dir": d, "student": student, "teacher": teacher, "other": other}


@pytest.fixture(scope="module")
def servers(models):
    """An embedded server over the teacher and one over the other-tokenizer teacher."""
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers

    with launch_embedded_servers(models["teacher"]) as good, \
            launch_embedded_servers(models["other"]) as other:
        yield {"teacher": good.urls[0], "other": other.urls[0]}


def test_teacher_scores_response_tokens_as_transformers(models, servers):
    """The prefill-only request returns the teacher's log-prob of each response token (the
    entry of the prompt's last token skipped), equal to transformers' in fp32; the server's
    reply has SGLang's shape: one entry per token from logprob_start_len, the first None, of
    the unscaled logits whatever the request's temperature."""
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.orchestration.teacher import TeacherClient, prefill_request

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    pairs = list(zip(batch.prompt_ids, batch.response_ids))
    p, r = pairs[0]
    (reply,) = RolloutClient([servers["teacher"]]).post_balanced("/generate",
                                                                 [prefill_request(p, r)])
    entries = reply["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [p[-1], *r] and entries[0][0] is None
    assert reply["output_ids"] == []  # prefill only
    hot = {**prefill_request(p, r), "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}}
    (reply_hot,) = RolloutClient([servers["teacher"]]).post_balanced("/generate", [hot])
    assert reply_hot["meta_info"]["input_token_logprobs"] == entries  # unscaled, as SGLang's
    got = TeacherClient([servers["teacher"]]).logprobs(pairs)
    hf, _ = load_reference(models["teacher"])
    for (p, r), lps in zip(pairs, got):
        want = reference_logprobs(hf, p + r)[-len(r):]
        assert len(lps) == len(r)
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=0)


def _advantage_step(rank, world, student, url):
    """The trainer's per-token advantages on a fixed batch: teacher log-probs from the served
    teacher, old log-probs from the Megatron student (the trainer's recompute), then
    ``token_advantages`` as the loss calls it; plain, and under a rollout correction."""
    from megatron_klear.algo.rl_objective import old_logprobs, token_advantages
    from megatron_klear.algo.rollout_correction import RolloutCorrection
    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.data.microbatches import pad_microbatches
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.rollout.orchestration.teacher import TeacherClient
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    batch.loss_masks = [[1] * len(r) for r in batch.response_ids]
    batch.loss_masks[1][2:4] = [0, 0]  # a tool response inside sample 1: no advantage
    batch.rollout_logprobs = [[-0.1 * (j + 1) for j in range(len(r))]
                              for r in batch.response_ids]
    batch.teacher_logprobs = TeacherClient([url]).logprobs(
        list(zip(batch.prompt_ids, batch.response_ids)))
    cfg = RLConfig(hf_checkpoint=str(student), prompt_data="unused", mini_batch_size=2,
                   rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=4)
    arch = qwen3_config_from_hf(load_hf_config(student))
    engine = build_engine(cfg, arch, with_optimizer=False)
    load_hf_weights(engine.model, arch, SafetensorsReader(student))
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    mbs = pad_microbatches(batch, list(range(4)), 4, 0, seq_len)
    old_logprobs(engine, mbs, arch.vocab_size, 1.0)
    (mb,) = mbs
    plain, _ = token_advantages(mb, None, LAMBDA)
    corrected, _ = token_advantages(mb, RolloutCorrection("tis", "token", 1.5), LAMBDA)
    return {"plain": plain, "corrected": corrected, "old": mb["old_logprobs"],
            "batch": batch}


def test_trainer_advantage_matches_hand_computation(models, servers):
    """A_t = A_task - lambda (log pi_student - log pi_teacher) per trained token, by hand from
    transformers' student and teacher log-probs; a masked (tool) token keeps A_task only;
    under a rollout correction the student's log-prob is the engine's, times the TIS
    weight min(exp(old - rollout), cap)."""
    (out,) = run_distributed(_advantage_step, 1, str(models["student"]), servers["teacher"])
    batch = out["batch"]
    hs, _ = load_reference(models["student"])
    ht, _ = load_reference(models["teacher"])
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        cols = slice(len(p) - 1, len(p) - 1 + len(r))
        student = reference_logprobs(hs, p + r)[-len(r):]
        teacher = reference_logprobs(ht, p + r)[-len(r):]
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        task = batch.advantages[i]
        want = task - LAMBDA * (student - teacher) * mask
        torch.testing.assert_close(out["plain"][i, cols], want, atol=2e-4, rtol=0)
        engine = torch.tensor(batch.rollout_logprobs[i])
        weight = torch.clamp(torch.exp(out["old"][i, cols] - engine), max=1.5)
        want_corr = (task - LAMBDA * (engine - teacher) * mask) * weight
        torch.testing.assert_close(out["corrected"][i, cols] * mask, want_corr * mask,
                                   atol=2e-4, rtol=0)
        assert (student - teacher).abs().max() > 0.05  # the teacher's term is not noise
    assert float(out["plain"][1, len(batch.prompt_ids[1]) + 1]) == pytest.approx(
        batch.advantages[1])  # the masked tool token: A_task only


def _rl_train(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


def test_pure_distillation_run_logs_the_metrics(models, servers, tmp_path):
    """``klear-rl --use-opd --reward none``: every reward 0, so no group has a reward spread,
    yet none is dropped (each carries the teacher's signal); the whole advantage comes from
    the teacher; the step logs reverse KL, the teacher's mean log-prob and time. With
    ``--export-hf-interval 1`` the model after step 1 is exported beside the final one (the
    quickstart's --distill curve): a third model, neither the start nor the end."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                               for i in range(8)))
    argv = ["--hf-checkpoint", str(models["student"]), "--prompt-data", str(prompts),
            "--save", str(tmp_path / "ck"), "--reward", "none", "--use-opd",
            "--opd-teacher-urls", servers["teacher"], "--opd-kl-coef", str(LAMBDA),
            "--rollout-batch-size", "2", "--mini-batch-size", "2", "--n-samples-per-prompt",
            "2", "--micro-batch-size", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
            "--train-iters", "2", "--seed", "3", "--no-progress-bar",
            "--export-hf", str(tmp_path / "hf"), "--export-hf-interval", "1"]
    hist = run_distributed(_rl_train, 1, argv, timeout=400)[0]
    assert len(hist) == 2
    for m in hist:
        assert m["rollout/zero_adv_frac"] == 0 and m["rollout/groups_kept"] == 2
        assert m["train/opd_teacher_share"] == pytest.approx(1.0)
        assert m["train/opd_teacher_logprob"] < 0 and math.isfinite(m["train/opd_reverse_kl"])
        assert m["time/teacher_s"] > 0
    logged = read_metrics(tmp_path / "ck" / "metrics.jsonl")
    assert all("train/opd_reverse_kl" in m for m in logged)
    assert sorted(p.name for p in tmp_path.glob("hf*")) == ["hf", "hf_step1"]
    start, mid, end = (load_file(next(d.glob("*.safetensors")))["model.norm.weight"] for d in
                       (models["student"], tmp_path / "hf_step1", tmp_path / "hf"))
    assert not torch.equal(mid, start) and not torch.equal(mid, end)


def _exits_2_with_one_line(argv: list[str], wants: str, capsys) -> None:
    from megatron_klear.train import rl

    for extra in (["--dry-run"], []):
        with pytest.raises(SystemExit) as exit_info:
            rl.main([*argv, *extra])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_info.value.code == 2 and len(lines) == 1 and wants in lines[0], lines


def test_bad_teachers_and_flags_exit_2_with_one_line(models, servers, capsys, monkeypatch):
    """A teacher with another tokenizer (named with the student), a URL that does not
    answer, a checkpoint that does not exist, and flags without --use-opd or their teacher:
    exit 2 with one line in the dry run and the real run; the good teacher passes the dry
    run (the control)."""
    from megatron_klear.distributed import free_port
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prompts = models["dir"] / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    base = ["--hf-checkpoint", str(models["student"]), "--prompt-data", str(prompts)]
    opd = [*base, "--use-opd", "--opd-teacher-urls"]
    dead = f"http://127.0.0.1:{free_port()}"
    missing = models["dir"] / "no_teacher"
    for argv, wants in [
            ([*opd, servers["other"]], f"serves {models['other']}"),
            ([*opd, servers["other"]], f"--hf-checkpoint {models['student']}"),
            ([*opd, dead], f"--opd-teacher-urls {dead} does not answer"),
            ([*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(missing)],
             f"--opd-teacher-load {missing}: no such directory"),
            ([*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load",
              str(models["teacher"])], "not implemented yet"),
            ([*base, "--opd-kl-coef", "0.5"], "--opd-kl-coef applies with --use-opd"),
            ([*base, "--reward", "none"], "--reward none"),
            ([*base, "--use-opd"], "--opd-teacher-urls"),
            ([*opd, servers["teacher"], "--opd-teacher-temperature", "0.6"],
             "--opd-teacher-temperature 0.6"),
            ([*opd, servers["teacher"], "--opd-kl-coef", "0"], "--opd-kl-coef must be > 0"),
            ([*opd, servers["teacher"], "--loss-type", "gspo"], "--loss-type gspo")]:
        _exits_2_with_one_line(argv, wants, capsys)
    rl.main([*opd, servers["teacher"], "--dry-run"])
    assert '"dry_run"' in capsys.readouterr().out


def test_killed_gppo_opd_run_resumes_bitwise(models, servers, tmp_path):
    """GPPO + OPD with a served teacher, SIGKILLed after its second step and resumed: every
    step's loss, reverse KL, rewards and prompts equal an uninterrupted run's; some step mixes
    both signals (the teacher's share strictly between 0 and 1)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}.",
                                           "answer": "x"}) + "\n" for i in range(12)))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def cli(save):
        return [sys.executable, "-m", "megatron_klear.train.rl", "--hf-checkpoint",
                str(models["student"]), "--prompt-data", str(prompts), "--save", str(save),
                "--reward", "tests.reward_plugins:parity_reward", "--use-opd",
                "--opd-teacher-urls", servers["teacher"], "--opd-kl-coef", "0.5",
                "--rollout-batch-size", "2", "--mini-batch-size", "2",
                "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
                "--rollout-max-response-len", "8", "--lr", "1e-3", "--train-iters", "4",
                "--seed", "3", "--no-progress-bar", "--save-interval", "1"]

    ref_run = subprocess.Popen(cli(tmp_path / "ref"), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cli(tmp_path / "run"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert ref_run.wait(timeout=400) == 0, ref_run.stderr.read()[-3000:]
    subprocess.run(cli(tmp_path / "run"), check=True, env=env, capture_output=True)
    ref = {r["step"]: r for r in read_metrics(tmp_path / "ref" / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        for key in ("train/loss", "train/opd_reverse_kl", "train/opd_teacher_logprob",
                    "rollout/reward_mean", "data/prompt_indices"):
            assert got[step][key] == ref[step][key], (step, key)
    assert any(0 < r["train/opd_teacher_share"] < 1 for r in ref.values())
