"""MoE routing replay: what it costs and what it fixes, on a small Qwen3-MoE on this CPU.

  python benchmarks/bench_routing_replay.py [--steps 4] [--repeats 2]

The rollout server runs the model in bf16 while the trainer runs fp32, as SGLang (bf16) and
a trainer's fp32 master copy differ on a GPU: near-tied router scores then pick different
experts on the two sides. klear-rl runs the same seeded job with and without
``--use-routing-replay``, alternating, against the same server (``--rollout-urls``), and the
script prints per arm the train/rollout log-prob mismatch (mean |old - rollout| per response
token), the old-log-prob and train seconds per step, and the trainer's peak RSS, with the
replay/plain ratios measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from megatron_klear.models.tiny import save_tiny_hf_model
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from megatron_klear.train.metrics import read_metrics


def run_arm(hf: Path, data: Path, url: str, save: Path, steps: int, replay: bool) -> dict:
    """One klear-rl run; its mean metrics and the peak RSS of its process."""
    cmd = [sys.executable, "-m", "megatron_klear.train.rl", "--hf-checkpoint", str(hf),
           "--prompt-data", str(data), "--rollout-urls", url, "--save", str(save),
           "--reward", "tests.reward_plugins:parity_reward", "--rollout-batch-size", "8",
           "--mini-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "8",
           "--rollout-max-response-len", "48", "--no-dynamic-sampling", "--lr", "1e-4",
           "--train-iters", str(steps), "--seed", "7", "--no-progress-bar",
           "--no-probe-weights"] + (["--use-routing-replay"] if replay else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, psutil.Process(proc.pid).memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"klear-rl failed:\n{proc.stderr.read()[-3000:]}")
    hist = read_metrics(save / "metrics.jsonl")[1:]  # step 1 includes start-up
    mean = lambda k: statistics.mean(m[k] for m in hist)  # noqa: E731
    return {"mismatch": mean("train/mismatch_abs_logprob"), "old_s": mean("time/old_logprob_s"),
            "train_s": mean("time/train_s"), "rss_mib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-r3-"))
    hf = save_tiny_hf_model(root / "hf", moe=True, std=0.2, seed=0, hidden_size=128,
                            num_experts=16, num_experts_per_tok=4, num_hidden_layers=4)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "answer": "x"}) + "\n"
                            for i in range(64)))
    arms: dict[bool, list[dict]] = {False: [], True: []}
    with launch_embedded_servers(hf, dtype="bfloat16") as servers:
        for r in range(args.repeats):
            for replay in (False, True):
                arms[replay].append(run_arm(hf, data, servers.urls[0],
                                            root / f"{r}-{replay}", args.steps, replay))
    print(f"load average {os.getloadavg()[0]:.1f}; {args.repeats} x {args.steps} steps per arm")
    print(f"{'arm':<8} {'mismatch':>10} {'old_logprob_s':>14} {'train_s':>8} {'rss_MiB':>8}")
    means = {}
    for replay, runs in arms.items():
        means[replay] = {k: statistics.mean(x[k] for x in runs) for k in runs[0]}
        m = means[replay]
        print(f"{'replay' if replay else 'plain':<8} {m['mismatch']:>10.2e} {m['old_s']:>14.3f} "
              f"{m['train_s']:>8.3f} {m['rss_mib']:>8.0f}")
    ratio = {k: means[True][k] / means[False][k] for k in means[True]}
    print("replay/plain: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratio.items()))


if __name__ == "__main__":
    main()
