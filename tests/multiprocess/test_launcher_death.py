"""Ranks die with their launcher (issue 28): SIGKILL torchrun alone while klear-sft, klear-rl
or klear-eval runs under it; within 10 s nothing it started is left, neither in its process
tree nor in any worker's own session (torchrun starts each worker with start_new_session).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.rollout_helpers import cmdline

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("launcher")
    hf = save_tiny_hf_model(root / "hf", seed=0)
    data = write_arithmetic_data(root / "data", n_sft=40, n_rl=8, n_eval=8)
    return root, hf, data


def _torchrun(nproc: int, module: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", module, *map(str, args)]


def _command(kind: str, root: Path, hf: Path, data: dict) -> tuple[list[str], list[str]]:
    """The torchrun command of ``kind`` and the command-line parts of the children that must
    be running (mid-step, servers up) before the launcher is killed."""
    common = ["--hf-checkpoint", hf, "--train-iters", 10000, "--seed", 1, "--no-progress-bar",
              "--log-dir", root / kind]
    if kind == "sft":  # two ranks, mid-run once the first step is logged
        return _torchrun(2, "megatron_klear.train.sft", *common, "--data-path", data["sft"],
                         "--seq-length", 64, "--micro-batch-size", 1, "--global-batch-size",
                         2), ["megatron_klear.train.sft"]
    if kind == "rl":  # an embedded rollout server and math-verifier workers under the rank
        return _torchrun(1, "megatron_klear.train.rl", *common, "--prompt-data", data["rl"],
                         "--reward", "math", "--no-dynamic-sampling", "--rollout-batch-size",
                         2, "--mini-batch-size", 2, "--n-samples-per-prompt", 2,
                         "--rollout-max-response-len", 8), \
            ["megatron_klear.train.rl", "megatron_klear.rollout.engine.server",
             "megatron_klear.rewards.math"]
    return _torchrun(1, "megatron_klear.eval", "--model", hf, "--benchmark", data["eval"],
                     "--k", 64, "--max-new-tokens", 64, "--out-dir", root / kind), \
        ["megatron_klear.eval", "megatron_klear.rollout.engine.server"]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sessions(sids: set[int]) -> list[psutil.Process]:
    """Live processes in the sessions ``sids``."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sids and _running(p):
                found.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def _ready(kind: str, agent: subprocess.Popen, wanted: list[str], root: Path) -> bool:
    """Whether the run is mid-step (SFT, RL: a step logged) or generating (eval), with every
    ``wanted`` child started."""
    assert agent.poll() is None, f"{kind}: exited with {agent.poll()} before it was killed"
    kinds = [cmdline(p) for p in psutil.Process(agent.pid).children(recursive=True)]
    if not all(any(w in k for k in kinds) for w in wanted):
        return False
    metrics = root / kind / "metrics.jsonl"
    return kind == "eval" or metrics.is_file() and bool(metrics.read_text())


def _left(run: dict) -> dict[int, str]:
    """Processes of a killed run still alive: its tree and its workers' sessions."""
    alive = [p for p in run["family"] if _running(p)] + _sessions(run["workers"])
    return {p.pid: cmdline(p)[:100] for p in alive}


def test_sigkilled_torchrun_leaves_no_process(inputs):
    """The three launches run side by side; each torchrun is SIGKILLed once its run is
    mid-step, and must have taken everything with it 10 s later."""
    root, hf, data = inputs
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    runs = {}
    for kind in ("sft", "rl", "eval"):
        cmd, wanted = _command(kind, root, hf, data)
        runs[kind] = dict(wanted=wanted, agent=subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline, results = time.monotonic() + 300, {}
    try:
        while len(results) < len(runs):
            assert time.monotonic() < deadline, f"not started in time: {set(runs) - set(results)}"
            for kind, run in runs.items():
                if kind in results:
                    continue
                if "killed" not in run and _ready(kind, run["agent"], run["wanted"], root):
                    agent = psutil.Process(run["agent"].pid)
                    run.update(workers={p.pid for p in agent.children()},
                               family=agent.children(recursive=True))
                    run["agent"].send_signal(signal.SIGKILL)  # the launcher alone
                    run["agent"].wait()
                    run["killed"] = time.monotonic()
                elif "killed" in run:
                    left = _left(run)
                    if not left or time.monotonic() - run["killed"] > 10:
                        results[kind] = dict(workers=len(run["workers"]), left=left)
            time.sleep(0.2)
    finally:
        for run in runs.values():
            run["agent"].kill()
            for pid in _left(run) if "killed" in run else ():  # leave nothing to other tests
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert results == {"sft": dict(workers=2, left={}), "rl": dict(workers=1, left={}),
                       "eval": dict(workers=1, left={})}, results
