"""Per-step phase times of colocated against separate klear-rl on the quickstart task (issue 31).

  python benchmarks/bench_colocate_phases.py --sft runs/quickstart [--rl-iters 10] [--out DIR]

From the SFT model of a finished quickstart (``--sft``: its --out directory), RL runs with
the quickstart's flags (TP=2 on 2 ranks), separate then ``--colocate``, alternating
``--rounds`` times so machine load hits both alike. Separate: one embedded server beside the
trainer, NCCL/gloo broadcast sync. Colocated: one embedded server per rank (``world /
--sglang-tp-size``), engines released while the trainer trains, trainer offloaded while they
roll out, weights by tensor handle. Prints per mode the median over steps of each phase and
of the run's wall time per step (the markdown rows of docs/results.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from megatron_klear.quickstart import rl_args, run_logged, torchrun_cmd
from megatron_klear.train.metrics import read_metrics

PHASES = ["time/rollout_s", "time/engine_release_s", "time/trainer_onload_s",
          "time/old_logprob_s", "time/train_s", "time/colocate_before_sync_s",
          "weight_sync/seconds", "time/colocate_after_sync_s"]
MODES = {"separate": [], "colocated": ["--colocate"]}


def _run(sft: Path, out: Path, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One RL run; per phase the median over its steps, and wall seconds per step."""
    ns = argparse.Namespace(rl_lr=2e-4, rl_iters=args.rl_iters, seed=1, colocate=False)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run_logged(torchrun_cmd(2, "megatron_klear.train.rl",
                            rl_args(out, ns, start=sft / "sft_hf") + MODES[mode]),
               out / "rl.log")
    wall = (time.time() - t0) / args.rl_iters
    hist = read_metrics(out / "rl_ckpt" / "metrics.jsonl")
    row = {k: statistics.median(m.get(k, 0.0) for m in hist) for k in PHASES}
    row["probe_max"] = max(m["weight_sync/probe_max_abs_diff"] for m in hist)
    row["wall_per_step_s"] = wall
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft", required=True, help="a finished quickstart's --out directory")
    p.add_argument("--out", default="runs/colocate_phases")
    p.add_argument("--rl-iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            rows[mode].append(_run(Path(args.sft), Path(args.out) / f"{mode}_{r}", mode, args))
    keys = PHASES + ["wall_per_step_s", "probe_max"]
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rl_iters} steps x {args.rounds} rounds")
    print("| mode | " + " | ".join(k.split("/")[-1] for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for mode, runs in rows.items():
        cells = [statistics.median(run[k] for run in runs) for k in keys]
        print(f"| {mode} | " + " | ".join(f"{c:.3g}" for c in cells) + " |")


if __name__ == "__main__":
    main()
