"""Every example script parses (bash -n) and validates its config with --dry-run, no GPUs."""

import concurrent.futures
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").rglob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


TRAINERS = [s for s in SCRIPTS if s.name.startswith("run_")]
COLOCATE = ROOT / "examples" / "single_node_8gpu" / "run_rl_colocate.sh"
SMALL_POOL = ("--sglang-mem-fraction-static", "0.1")  # a KV pool too small for a sequence


# two dry runs side by side: each is one process of imports and arithmetic (one core), so a
# 2-core box runs the scripts' dry runs in about half the time
_LAUNCHER = concurrent.futures.ThreadPoolExecutor(2)


@functools.cache
def _started(script: Path, *extra: str) -> concurrent.futures.Future:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    return _LAUNCHER.submit(subprocess.run, ["bash", str(script), "--dry-run", *extra], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)


def dry_run(script: Path, *extra: str) -> subprocess.CompletedProcess:
    """``bash script --dry-run *extra``, launched once per command line: the tests that check
    different things of the same dry run share it."""
    return _started(script, *extra).result()


@pytest.fixture(scope="module")
def trainer_dry_runs() -> Iterator[None]:
    """Start every trainer script's dry run (and the colocated plan's failing variant) at
    once, two at a time, for the tests below to take as they come; the ones a selection of
    tests did not take are cancelled at the module's end."""
    started = [_started(script) for script in TRAINERS] + [_started(COLOCATE, *SMALL_POOL)]
    yield
    for future in started:
        future.cancel()


def dry_run_report(proc: subprocess.CompletedProcess) -> dict:
    """The JSON report a dry run prints after its log lines."""
    return json.loads(proc.stdout[proc.stdout.index("{"):])


@pytest.mark.parametrize("script", TRAINERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_dry_run_validates_config(trainer_dry_runs, script):
    proc = dry_run(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dry_run_report(proc)
    assert out["dry_run"]["data_parallel_size"] >= 1
    assert out["config"]["bf16"] is True
    memory = out["dry_run"]["memory"]  # planned from the shipped hf_config/config.json
    assert memory["fits"] and memory["gpu_memory_gb"] == 80
    assert memory["gib"]["total"] < 0.8 * 80, memory  # with margin


def test_dry_run_8b_layout_without_memory_features_does_not_fit():
    """Issue 13's arithmetic: Qwen3-8B SFT at 32K, TP4 PP2 (4 nodes), flash attention and
    none of the memory features needs ~96 GB on pipeline stage 0; the dry run fails and
    names the flags that would fit."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", WORLD_SIZE="32")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_klear.train.sft", "--dry-run",
         "--hf-checkpoint", "examples/klear_8b/hf_config", "--data-path",
         "examples/data/sft_sample.jsonl",
         "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
         "--seq-length", "32768", "--global-batch-size", "64", "--bf16",
         "--transformer-impl", "transformer_engine"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    memory = json.loads(proc.stdout[proc.stdout.index("{"):])["dry_run"]["memory"]
    assert not memory["fits"] and memory["binding_stage"] == 0
    assert 90e9 < memory["gib"]["total"] * 2**30 < 100e9, memory
    err = proc.stderr.strip().splitlines()[-1]
    assert "does not fit --gpu-memory-gb 80" in err and "--recompute-granularity full" in err


def test_dry_run_rejects_inconsistent_layout():
    env = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore", NNODES="1",
               GPUS_PER_NODE="6")  # TP4 x PP2 = 8 does not divide 6 GPUs
    proc = subprocess.run(["bash", "examples/klear_8b/run_sft.sh", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "does not divide" in proc.stderr


def test_launch_sglang_dry_run_prints_servers():
    proc = subprocess.run(["bash", "examples/klear_8b/launch_sglang.sh", "--dry-run"], cwd=ROOT,
                          env=dict(os.environ, SERVER_TP="2", HOST="10.0.0.5"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.count("sglang.launch_server") == 4 and "http://10.0.0.5:30003" in proc.stdout
    # SGLang's flag is --tp-size; --tp works only as an argparse prefix of it
    assert proc.stdout.count("--tp-size 2") == 4 and " --tp " not in proc.stdout
    assert " --tp " not in (ROOT / "examples" / "single_node_8gpu" / "run_rl.sh").read_text()


def test_quickstart_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_klear.quickstart", "--dry-run",
                           "--out", str(tmp_path / "qs")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("config OK") == 2 and not (tmp_path / "qs").exists()


def test_quickstart_tools_dry_run(tmp_path):
    """--tools: klear-sft takes the tool trajectories and klear-rl the --tools flags."""
    proc = subprocess.run([sys.executable, "-m", "megatron_klear.quickstart", "--dry-run",
                           "--tools", "--out", str(tmp_path / "qs")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("config OK") == 2 and not (tmp_path / "qs").exists()


def test_quickstart_distill_dry_run(tmp_path):
    """--distill: klear-sft, the teacher's klear-rl and the three arms' klear-rl (the OPD arms
    asking a served stand-in teacher for its tokenizer) validate; nothing is written."""
    proc = subprocess.run([sys.executable, "-m", "megatron_klear.quickstart", "--dry-run",
                           "--distill", "--out", str(tmp_path / "qs")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("config OK") == 5 and not (tmp_path / "qs").exists()
    for arm in ("(teacher)", "(gppo)", "(opd)", "(gppo+opd)"):
        assert f"megatron_klear.train.rl {arm}: config OK" in proc.stdout, proc.stdout


def _colocate_dry_run(*extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = dry_run(COLOCATE, *extra)  # without extra: test_dry_run_validates_config's run
    return proc, dry_run_report(proc)["dry_run"]


def test_colocated_8b_dry_run_plans_both_phases(trainer_dry_runs):
    """Qwen3-8B at 32K colocated on 8 x 80 GB (TP4 x DP2 trainer, four TP2 engines): the
    plan fits, with the engine weights and KV cache computed by hand: 8.19e9 parameters in
    bf16 over TP2 = 7.63 GiB per GPU; a KV token = 2 (K, V) x 36 layers x 8/2 KV heads x 128
    x 2 bytes = 73728 bytes, 2.53 GiB per 36864-token sequence (the recipe's 4096-token
    prompts + 32768 new tokens); (0.85 x 80 - 7.63) GiB of pool = 23.85 sequences. At
    --sglang-mem-fraction-static 0.1 (8 GiB: 0.37 GiB of KV) the dry run fails, naming the
    rollout phase and the fraction that fits (a pool of at least 7.63 + 2.53 = 10.16 GiB:
    0.13)."""
    proc, report = _colocate_dry_run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    colo = report["colocated"]
    assert colo["fits"] and colo["engine_weights_gib"] == 7.63, colo
    assert abs(colo["kv_sequences"] - 23.85) < 0.06, colo
    assert colo["training_gib"] == round(report["memory"]["gib"]["total"] + 2.0, 2)
    # host memory per node (issue 51, defect 5): the offloaded state pinned per rank (the
    # trainer's params + grads + optimizer state), 8 ranks a node, each process's own on top
    host, gib = report["host"], report["memory"]["gib"]
    assert abs(host["pinned_gib_per_rank"] - gib["params"] - gib["grads"] - gib["optimizer"]) \
        <= 0.02, (host, gib)
    assert host["ranks_per_node"] == 8 and host["fits"]
    assert host["total_gib_per_node"] == round(host["pinned_gib_per_node"] + 8 * 4.0, 2)
    proc, report = _colocate_dry_run("--host-memory-gb", "64")
    assert proc.returncode == 2 and not report["host"]["fits"]
    err = proc.stderr.strip().splitlines()[-1]
    assert "host memory plan: 215.1 GiB per node (183.1 pinned" in err, err
    assert "--host-memory-gb 64" in err, err
    proc, report = _colocate_dry_run(*SMALL_POOL)
    assert proc.returncode == 2 and not report["colocated"]["fits"]
    err = proc.stderr.strip().splitlines()[-1]
    assert "holds no 36864-token sequence" in err, err
    assert "--sglang-mem-fraction-static 0.13" in err, err
