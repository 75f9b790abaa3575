"""Tokens/s of a full GPPO RL step on the quickstart-sized model, by phase.

  python benchmarks/bench_rl_step.py [--steps 5]

Runs klear-rl (torchrun, 2 CPU ranks, TP=2, one embedded rollout server) and reads the
per-phase timings and the wall clock per step from its metrics stream. Where TRL is installed it also runs TRL's
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
    records = read_metrics(work / "ck" / "metrics.jsonl")
    rows = records[1:]  # step 1 includes warm-up
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in PHASES + ("rollout/response_len",)}
    samples = args.prompts * args.n
    gen_tokens = samples * mean["rollout/response_len"]
    step_s = (records[-1]["time"] - records[0]["time"]) / len(rows)  # wall clock per step
    print(f"RL step ({args.prompts} prompts x {args.n} samples, TP=2 on 2 CPU cores), "
          f"mean of {len(rows)} steps:")
    for k in PHASES:
        print(f"  {k:24s} {mean[k]:7.3f} s  ({100 * mean[k] / step_s:4.1f}% of the wall step)")
    print(f"  total {step_s:.2f} s/step, {gen_tokens / step_s:.0f} generated tokens/s end to end, "
          f"{gen_tokens / mean['time/generate_s']:.0f} tokens/s in generation")
    result = {"seconds_per_step": step_s, **mean}
    if importlib.util.find_spec("trl") is None:
        print("TRL: not installed here, no GRPOTrainer comparison (pip install trl to add it)")
    else:
        out = subprocess.run([sys.executable, __file__, "--trl-worker", str(hf), str(data["rl"]),
                              str(args.prompts), str(args.n), str(args.steps)],
                             capture_output=True, text=True, check=True)
        trl_s = json.loads(out.stdout.strip().splitlines()[-1])["seconds_per_step"]
        result["trl_seconds_per_step"] = trl_s
        print(f"TRL GRPOTrainer, same model/prompts/n/length/reward (1 process, 2 threads): "
              f"{trl_s:.2f} s/step -> megatron-klear is {trl_s / step_s:.2f}x faster per RL step")
    print(json.dumps(result))


def trl_worker(hf: str, prompts: str, num_prompts: int, n: int, steps: int) -> None:
    """TRL's GRPOTrainer on the same setup; prints the mean seconds per RL step."""
    import time

    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_klear.rewards import score_batch

    torch.set_num_threads(2)
    ds = load_dataset("json", data_files=prompts, split="train").map(
        lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})

    def reward(completions, answer, **_):
        return score_batch("math", [c[0]["content"] for c in completions], list(answer))

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=num_prompts * n // 2,
                     gradient_accumulation_steps=2, num_generations=n, max_completion_length=48,
                     temperature=1.0, beta=0.0, learning_rate=2e-4, max_steps=steps,
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                     bf16=False, seed=0)
    trainer = GRPOTrainer(model=hf, reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    laps = [b - a for a, b in zip([start] + stamps, stamps)][1:]  # step 1 includes warm-up
    print(json.dumps({"seconds_per_step": sum(laps) / len(laps)}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
    else:
        main()
