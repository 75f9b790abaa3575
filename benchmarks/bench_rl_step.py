"""RL step speed: packed vs padded training on long-tail lengths, and sync vs async rollouts.

  python benchmarks/bench_rl_step.py [--steps 5] [--repeats 2] [--part all|packing|async]

Part 1 (packing): the training phase of one RL step (old log-probs where needed + one
optimizer step) on a rollout batch with long-tail response lengths (max/mean ~ 4), padded
micro-batches vs THD token-budget packs (--max-tokens-per-gpu), alternating in one process
(TP=1, 1 rank, 2 threads); tokens/s counts real (non-padding) tokens.

Against TRL's GRPOTrainer: benchmarks/bench_vs_trl.py (issue 42; this file's earlier
``--part trl`` configured TRL with its gradient checkpointing on and the project's chat template).

Part 2 (async): wall seconds per RL step of klear-rl synchronous vs ``--async-rollout``
(--max-staleness 1, --async-inflight pause_in_place), same seeds, model, prompts and embedded
server, runs alternating; ratio sync / async (> 1: async is faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

# name -> (model overrides, prompts, samples per prompt, max new tokens)
SETTINGS = {
    "bench": ({}, 32, 8, 48),
    "held-out": ({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                  "head_dim": 32}, 16, 8, 32),
}


# --------------------------------------------------------------------------- part 1: packing

def long_tail_batch(prompts: int, n: int, mean_len: int, seed: int = 0):
    """A rollout batch whose response lengths are exponential (mean ``mean_len``), capped at
    4 x mean: max/mean ~ 4, most responses short, a few long (the long-CoT shape)."""
    import random

    from megatron_klear.algo.advantages import group_advantages
    from megatron_klear.samples import RolloutBatch

    import torch

    rng = random.Random(seed)
    b = RolloutBatch(group_size=n)
    for i in range(prompts * n):
        if i % n == 0:
            prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(16, 33))]
        length = min(4 * mean_len, max(1, math.ceil(rng.expovariate(1.0 / mean_len))))
        b.prompt_ids.append(prompt)
        b.response_ids.append([rng.randrange(3, 90) for _ in range(length)])
        b.rollout_logprobs.append([-1.0] * length)
        b.rewards.append(float(rng.random() < 0.4))
        b.prompt_index.append(i // n)
        b.truncated.append(False)
    b.advantages = group_advantages(torch.tensor(b.rewards), n).tolist()
    return b


def packing_part(work: Path, repeats: int) -> dict:
    """Training-phase tokens/s of padded vs packed micro-batches, alternating."""
    import torch

    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.models.tiny import save_tiny_hf_model
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig, train_on_batch

    torch.set_num_threads(2)
    os.environ.setdefault("MASTER_PORT", "29647")
    hf = save_tiny_hf_model(work / "hf_tail", seed=0, **SETTINGS["held-out"][0])
    batch = long_tail_batch(16, 8, mean_len=64)
    resp = [len(r) for r in batch.response_ids]
    seqs = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    real = sum(seqs)
    micro = 16
    budget = micro * real // len(seqs)  # same number of micro-batches on average
    base = dict(hf_checkpoint=str(hf), prompt_data="unused", rollout_batch_size=16,
                mini_batch_size=16, n_samples_per_prompt=8, lr=1e-5, seed=0)
    modes = {"padded": RLConfig(**base, micro_batch_size=micro, pack_sequences=False),
             "packed": RLConfig(**base, micro_batch_size=1, max_tokens_per_gpu=budget)}
    for cfg in modes.values():
        cfg.validate()
        cfg.derive()  # sequences per optimizer step, as parse_config sets them
    initialize_parallel(1, 1, seed=0)
    engine = build_engine(modes["padded"], qwen3_config_from_hf(load_hf_config(hf)))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(repeats + 1):  # the first round warms up
        for mode, cfg in modes.items():
            engine.cfg = cfg
            t0 = time.perf_counter()
            train_on_batch(engine, cfg, batch, pad_id=0)
            if rep:
                times[mode].append(time.perf_counter() - t0)
    rate = {m: real / statistics.median(t) for m, t in times.items()}
    padded_tokens = len(seqs) * (max(seqs) - 1)
    print(f"Part 1: training phase, {len(seqs)} rollout sequences, response lengths mean "
          f"{statistics.mean(resp):.0f} max {max(resp)} (max/mean "
          f"{max(resp) / statistics.mean(resp):.1f}); held-out model (hidden 128, 4 layers), "
          f"TP=1, 1 rank, 2 threads, median of {repeats}")
    print(f"  padded ({micro} seqs/micro-batch, to the longest): {padded_tokens} token slots, "
          f"{rate['padded']:8.0f} real tokens/s")
    print(f"  packed (THD, --max-tokens-per-gpu {budget}):          {real - len(seqs)} token "
          f"slots, {rate['packed']:8.0f} real tokens/s")
    print(f"  packed / padded: {rate['packed'] / rate['padded']:.2f}x (target >= 1.5x)")
    return {"packing_tokens_per_s": rate, "packing_ratio": rate["packed"] / rate["padded"]}


# --------------------------------------------------------------------------- RL runs

def klear_step(hf: Path, data: Path, work: Path, prompts: int, n: int, max_new: int,
               steps: int, flags: Sequence[str] = ()) -> dict:
    """Mean wall seconds per RL step (steps 2..) and mean phases of one klear-rl run on one
    rank (``flags``: more klear-rl flags). Beyond them the command carries only the work's
    own (batch, samples, length, LR, steps) and ``--no-dynamic-sampling``."""
    from megatron_klear.train.metrics import read_metrics

    save = Path(tempfile.mkdtemp(dir=work, prefix="klear_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=1", "-m", "megatron_klear.train.rl", "--hf-checkpoint",
           str(hf), "--prompt-data", str(data), *flags, "--rollout-batch-size", str(prompts),
           "--mini-batch-size", str(prompts), "--n-samples-per-prompt", str(n),
           "--rollout-max-response-len", str(max_new), "--no-dynamic-sampling",
           "--train-iters", str(steps), "--save", str(save), "--no-progress-bar",
           "--lr", "2e-4"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"klear-rl failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    records = read_metrics(save / "metrics.jsonl")
    rows = records[1:]  # step 1 includes warm-up
    out = {k: statistics.mean(r.get(k, 0.0) for r in rows)
           for k in ("time/rollout_s", "time/generate_s", "time/train_s",
                     "weight_sync/seconds", "rollout/staleness")}
    out["seconds_per_step"] = (records[-1]["time"] - records[0]["time"]) / len(rows)
    return out


# --------------------------------------------------------------------------- part 2: async

ASYNC_FLAGS = ["--async-rollout", "--max-staleness", "1", "--async-inflight", "pause_in_place"]
# name -> flags, on one rank. At the defaults a synchronous run gives the trainer and then
# the embedded servers every core in turn, and an async run, where they overlap, half each;
# "-1thread" sets the trainer to one thread, as the async rounds before the defaults did.
ASYNC_MODES = {"sync": [], "async": ASYNC_FLAGS,
               "sync-1thread": ["--cpu-threads", "1"],
               "async-1thread": ASYNC_FLAGS + ["--cpu-threads", "1"]}


def async_part(work: Path, steps: int, repeats: int, setting: str) -> dict:
    """Seconds per RL step, synchronous vs --async-rollout, alternating in one run."""
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    data = write_arithmetic_data(work / "data_async")["rl"]
    arch, prompts, n, max_new = SETTINGS[setting]
    hf = save_tiny_hf_model(work / f"hf_async_{setting}", seed=0, **arch)
    runs: dict[str, list] = {m: [] for m in ASYNC_MODES}
    for _ in range(repeats):
        for mode, flags in ASYNC_MODES.items():
            runs[mode].append(klear_step(hf, data, work, prompts, n, max_new, steps,
                                         flags))
    med = {m: statistics.median(r["seconds_per_step"] for r in rs) for m, rs in runs.items()}
    print(f"Part 2 [{setting}]: sync vs async, {prompts} prompts x {n} samples, {max_new} new "
          f"tokens, 1 rank + embedded servers at their defaults; median of {repeats} runs of "
          f"{steps} steps "
          "(step 1 dropped)")
    for mode, rs in runs.items():
        ph = {k: statistics.median(r[k] for r in rs)
              for k in ("time/rollout_s", "time/generate_s", "time/train_s",
                        "weight_sync/seconds", "rollout/staleness")}
        laps = ", ".join(f"{r['seconds_per_step']:.3f}" for r in rs)
        print(f"  {mode:14s} {med[mode]:6.3f} s/step (runs: {laps}; wait for batch "
              f"{ph['time/rollout_s']:.3f}, generate {ph['time/generate_s']:.3f}, train "
              f"{ph['time/train_s']:.3f}, sync {ph['weight_sync/seconds']:.3f}, staleness "
              f"{ph['rollout/staleness']:.2f})")
    best = {m: min((k for k in med if k.startswith(m)), key=med.get) for m in ("sync", "async")}
    ratio = med[best["sync"]] / med[best["async"]]
    for suffix in ("", "-1thread"):
        same = med[f"sync{suffix}"] / med[f"async{suffix}"]
        print(f"  trainer threads {suffix.strip('-') or 'default'}: sync / async {same:.2f}x")
    print(f"  best sync ({best['sync']}) / best async ({best['async']}): {ratio:.2f}x per RL step "
          "(> 1: async faster; target: faster)")
    return {"async_seconds_per_step": med, "async_best": best, "async_speedup": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--part", choices=("all", "packing", "async"), default="all")
    p.add_argument("--setting", default="bench", choices=sorted(SETTINGS),
                   help="the async part's shape")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores; other jobs slow both sides)")
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    result = {}
    if args.part in ("all", "packing"):
        result.update(packing_part(work, args.repeats))
    if args.part in ("all", "async"):
        result.update(async_part(work, args.steps, args.repeats, args.setting))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
