"""SFT trainer: learning at TP=2/PP=2, layout-changing resume, and exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("sft")
    hf = save_tiny_hf_model(root / "hf", seed=0)
    data = write_arithmetic_data(root / "data", n_sft=300, n_rl=10, n_eval=10)
    return root, hf, data["sft"]


def _args(hf, data, save, iters, *extra):
    return ["--hf-checkpoint", str(hf), "--data-path", str(data), "--save", str(save),
            "--train-iters", str(iters), "--seq-length", "128", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "2e-3", "--seed", "5", "--no-progress-bar", *extra]


def _train(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.sft import SFTConfig, train

    return [m["loss"] for m in train(load_config(SFTConfig, argv))]


def test_tp2_learns_and_resumes_at_pp2(setup):
    root, hf, data = setup
    full = run_distributed(_train, 2, _args(hf, data, root / "tp2_full", 6,
                                              "--tensor-model-parallel-size", "2",
                                              "--save-interval", "3"))[0]
    assert full[-1] < 0.85 * full[0]  # TP=2 lowers the loss (4.62 -> 3.74 in 6 steps)
    # the same run's step-3 checkpoint (a 3-step run of its own would repeat steps 1-3)
    resumed = run_distributed(_train, 2, _args(hf, data, root / "pp2", 6,
                                                 "--pipeline-model-parallel-size", "2", "--load",
                                                 str(root / "tp2_full" / "iter_0000003")))[0]
    assert len(resumed) == 3  # steps 4..6 only
    for got, want in zip(resumed, full[3:]):  # weights, optimizer and data position carried over
        assert abs(got - want) < 1e-5, (resumed, full[3:])
    assert resumed[-1] < full[0]  # PP=2 keeps lowering the loss


def _cli(hf, data, save, iters, *extra):
    return [sys.executable, "-m", "megatron_klear.train.sft",
            *_args(hf, data, save, iters, "--save-interval", "2", "--keep-last", "10", *extra)]


def _final_by_step(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(path)}  # later records win (the resumed ones)


def _stop_when(proc, ready, timeout=120):
    """Freeze the trainer (SIGSTOP) at the first moment ``ready()`` holds, then SIGKILL it."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if ready():
            proc.send_signal(signal.SIGSTOP)
            if ready():  # still true while frozen: the kill lands exactly there
                proc.kill()
                proc.wait()
                return True
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    return False


def _kill_at(proc, run_dir: Path, where: str) -> None:
    """SIGKILL the trainer ``proc`` at ``where``: "mid_training" once step 5 is logged (the
    fresh run of the chain), "while_saving" while iter 6 is being written (the run resumed
    from iter 4): the interrupted save must never be published."""
    metrics = run_dir / "metrics.jsonl"

    def ready() -> bool:
        if where == "mid_training":
            return metrics.exists() and len(metrics.read_text().splitlines()) >= 5
        return any(p.name.endswith(".tmp") and p.name.startswith(".iter_0000006")
                   for p in run_dir.glob(".iter_*"))

    assert _stop_when(proc, ready), f"the trainer finished before the kill point {where}"
    if where == "while_saving":
        assert not (run_dir / "iter_0000006").exists()  # the interrupted save never published


@pytest.mark.parametrize("flags,kills", [((), ("mid_training", "while_saving"))],
                         ids=["mid_training_then_while_saving"])
def test_sigkill_resume_is_exact(setup, flags, kills):
    # the distributed optimizer's SIGKILL resume: test_dist_optim_resume.py (the whole process
    # group killed, bf16, TP1 x DP2 and TP2 x DP2, with LoRA)
    """One run killed at each of ``kills`` in turn (each kill in the run resumed after the
    previous one: mid-training after step 5, then while saving iter 6), then resumed to the
    end: the same losses and samples as the uninterrupted 8-step run with the same flags
    (which runs side by side with the killed ones), bitwise, none repeated."""
    root, hf, data = setup
    tag = "".join(flags).replace("-", "_")
    run_dir, ref_dir = root / f"run{tag}", root / f"ref{tag}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ref_run = subprocess.Popen(_cli(hf, data, ref_dir, 8, *flags), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for where in kills:
        proc = subprocess.Popen(_cli(hf, data, run_dir, 8, *flags), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _kill_at(proc, run_dir, where)
    subprocess.run(_cli(hf, data, run_dir, 8, *flags), check=True, env=env, capture_output=True)
    assert ref_run.wait(timeout=300) == 0, "the uninterrupted run failed"
    ref = _final_by_step(ref_dir / "metrics.jsonl")
    got = _final_by_step(run_dir / "metrics.jsonl")
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    for step in range(1, 9):  # bitwise-identical losses, identical samples, in order
        assert got[step]["loss"] == ref[step]["loss"], step
        assert got[step]["samples"] == ref[step]["samples"], step
    seen = [i for s in range(1, 9) for i in got[s]["samples"]]
    assert len(seen) == len(set(seen))  # no sample repeated within the epoch


def test_bad_input_names_file_and_line(setup, tmp_path, capsys, monkeypatch):
    """klear-sft's main (the console script's function, in this process): a record without
    a response and an empty response exit 2 naming FILE:LINE, in the pre-flight (before any
    model is built: megatron's parallel state stays as it was)."""
    from megatron.core import parallel_state

    from megatron_klear.train.sft import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    state_before = parallel_state.model_parallel_is_initialized()
    root, hf, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" +
                   json.dumps({"prompt": "a"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "a", "response": "  "}) + "\n")
    for data, wants in ((bad, (f"{bad}:2", "response")), (empty, ("empty response",))):
        with pytest.raises(SystemExit) as exit_info:
            main(["--hf-checkpoint", str(hf), "--data-path", str(data), "--train-iters", "1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and all(w in err for w in wants), err
        assert parallel_state.model_parallel_is_initialized() == state_before


def test_overflow_truncate_and_drop(setup):
    from transformers import AutoTokenizer

    from megatron_klear.data.sft import load_sft_dataset

    root, hf, data = setup
    tok = AutoTokenizer.from_pretrained(str(hf))
    # the records are 68 or 70 tokens long: 69 truncates some and keeps the others whole
    kept, st = load_sft_dataset(data, tok, max_length=69, overflow="truncate")
    assert 0 < st.truncated < len(kept) and all(len(s.input_ids) <= 69 for s in kept)
    kept2, st2 = load_sft_dataset(data, tok, max_length=69, overflow="drop")
    assert st2.dropped == st.truncated and len(kept2) == len(kept) - st.truncated


def test_max_tokens_per_gpu_bins(setup):
    """--max-tokens-per-gpu: bins of that many tokens (one THD pack per micro-batch),
    first-fit decreasing; bad combinations name the flags."""
    from transformers import AutoTokenizer

    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.data.sft import load_sft_dataset
    from megatron_klear.train.sft import BinSchedule, SFTConfig

    root, hf, data = setup
    cfg = parse_config(SFTConfig, _args(hf, data, root / "unused", 1, "--max-tokens-per-gpu",
                                        "512", "--micro-batch-size", "1"))
    samples, _ = load_sft_dataset(data, AutoTokenizer.from_pretrained(str(hf)), max_length=129)
    bins = BinSchedule(samples, cfg.bin_size, 5, True).epoch(0)
    small = BinSchedule(samples, cfg.seq_length, 5, True).epoch(0)
    fill = [sum(len(samples[i].input_ids) - 1 for i in b) for b in bins]
    assert max(fill) <= 512 and len(bins) < len(small) / 3  # 4x the bin, ~1/4 the bins
    assert sorted(i for b in bins for i in b) == list(range(len(samples)))
    with pytest.raises(ConfigError, match="--micro-batch-size 1"):
        parse_config(SFTConfig, _args(hf, data, root / "x", 1, "--max-tokens-per-gpu", "512"))
    with pytest.raises(ConfigError, match="--seq-length"):
        parse_config(SFTConfig, _args(hf, data, root / "x", 1, "--max-tokens-per-gpu", "64",
                                      "--micro-batch-size", "1"))
