"""RL step speed: packed vs padded training on long-tail lengths, and klear-rl vs TRL.

  python benchmarks/bench_rl_step.py [--steps 5] [--repeats 2] [--part all|packing|trl|async]

Part 1 (packing): the training phase of one RL step (old log-probs where needed + one
optimizer step) on a rollout batch with long-tail response lengths (max/mean ~ 4), padded
micro-batches vs THD token-budget packs (--max-tokens-per-gpu), alternating in one process
(TP=1, 1 rank, 2 threads); tokens/s counts real (non-padding) tokens.

Part 2 (trl): wall seconds per RL step (generate, reward, train, weight sync, probe) of
klear-rl (torchrun on 2 ranks + embedded rollout servers) and of TRL's GRPOTrainer (one
process, 2 threads) on the same model, prompts, n, length, reward and optimizer steps (one
per RL step), side by side and repeated, at two settings: this bench's own ("bench") and the
held-out issue-14 shape ("held-out": hidden 128, 4 layers, 16 prompts x 8 samples, 32 new
tokens, fp32). klear-rl runs at its defaults ("defaults": no tuning flag) and with one
default changed per layout (LAYOUTS); TRL in each of TRL_CONFIGS, and the ratio is taken
against TRL's fastest. TRL is not a dependency of megatron-klear: ``pip install trl`` adds
the peer column; without it the bench says so and prints klear-rl alone.

Part 3 (async): wall seconds per RL step of klear-rl synchronous vs ``--async-rollout``
(--max-staleness 1, --async-inflight pause_in_place), same seeds, model, prompts and embedded
server, runs alternating; ratio sync / async (> 1: async is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
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

PHASES = ("time/generate_s", "time/reward_s", "time/old_logprob_s", "time/train_s",
          "weight_sync/seconds")
# name -> (model overrides, prompts, samples per prompt, max new tokens)
SETTINGS = {
    "bench": ({}, 32, 8, 48),
    "held-out": ({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                  "head_dim": 32}, 16, 8, 32),
}
# klear-rl layouts: name -> (processes, flags beyond the work's own). "defaults" is the
# command a user types: torchrun on 2 ranks and no tuning flags, so prompt sharing, token
# packs, embedded servers (one per core) and threads (cores / ranks) take their defaults.
# The others change one default each, to show what it buys.
LAYOUTS = {
    "defaults": (2, []),
    "1srv-2threads": (2, ["--rollout-num-servers", "1"]),
    "no-share": (2, ["--no-share-prompts"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "1rank": (1, []),
    "raw-prompts": (2, ["--prompt-template", "raw"]),
    "1rank-raw-prompts": (1, ["--prompt-template", "raw"]),
}


# --------------------------------------------------------------------------- part 1: packing

def long_tail_batch(prompts: int, n: int, mean_len: int, seed: int = 0):
    """A rollout batch whose response lengths are exponential (mean ``mean_len``), capped at
    4 x mean: max/mean ~ 4, most responses short, a few long (the long-CoT shape)."""
    import random

    from megatron_klear.algo.advantages import group_advantages
    from megatron_klear.train.rl_data import RolloutBatch

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


# --------------------------------------------------------------------------- part 2: vs TRL

def klear_step(hf: Path, data: Path, work: Path, prompts: int, n: int, max_new: int,
               layout: str, steps: int, extra: Sequence[str] = ()) -> dict:
    """Mean wall seconds per RL step (steps 2..) and mean phases of one klear-rl run
    (``extra``: more klear-rl flags). Beyond the layout's flags the command carries only the
    work's own (batch, samples, length, LR, steps) and ``--no-dynamic-sampling``: TRL
    neither drops zero-advantage groups nor generates more to refill them."""
    from megatron_klear.train.metrics import read_metrics

    procs, flags = LAYOUTS[layout]
    save = Path(tempfile.mkdtemp(dir=work, prefix=f"klear_{layout}_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={procs}", "-m", "megatron_klear.train.rl", "--hf-checkpoint",
           str(hf), "--prompt-data", str(data), *flags, "--rollout-batch-size", str(prompts),
           "--mini-batch-size", str(prompts), "--n-samples-per-prompt", str(n),
           "--rollout-max-response-len", str(max_new), "--no-dynamic-sampling",
           "--train-iters", str(steps), "--save", str(save), "--no-progress-bar",
           "--lr", "2e-4", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"klear-rl failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    records = read_metrics(save / "metrics.jsonl")
    rows = records[1:]  # step 1 includes warm-up
    out = {k: statistics.mean(r.get(k, 0.0) for r in rows)
           for k in (*PHASES, "time/rollout_s", "rollout/staleness")}
    out["seconds_per_step"] = (records[-1]["time"] - records[0]["time"]) / len(rows)
    return out


def trl_step(hf: Path, data: Path, prompts: int, n: int, max_new: int, steps: int,
             config: str) -> float:
    out = subprocess.run([sys.executable, __file__, "--trl-worker", str(hf), str(data),
                          str(prompts), str(n), str(max_new), str(steps), config],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds_per_step"]


def trl_part(work: Path, steps: int, repeats: int, layouts: list[str], settings: list[str],
             trl_configs: list[str]) -> dict:
    """klear-rl's layouts and TRL's configurations, alternating, per setting; the ratio is
    TRL's fastest configuration over klear-rl at its defaults."""
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl:
        print("TRL: not installed here, no GRPOTrainer column (pip install trl to add it; it is "
              "not a megatron-klear dependency)")
        trl_configs = []
    data = write_arithmetic_data(work / "data")["rl"]
    result = {}
    for name in settings:
        arch, prompts, n, max_new = SETTINGS[name]
        hf = save_tiny_hf_model(work / f"hf_{name}", seed=0, **arch)
        runs: dict[str, list] = {lay: [] for lay in layouts}
        trl: dict[str, list[float]] = {c: [] for c in trl_configs}
        for _ in range(repeats):  # alternate, so that load changes hit both sides alike
            for lay in layouts:
                runs[lay].append(klear_step(hf, data, work, prompts, n, max_new, lay, steps))
            for c in trl_configs:
                trl[c].append(trl_step(hf, data, prompts, n, max_new, steps, c))
        med = {lay: statistics.median(r["seconds_per_step"] for r in rs)
               for lay, rs in runs.items()}
        print(f"Part 2 [{name}]: {prompts} prompts x {n} samples, {max_new} new tokens, model "
              f"{arch or 'quickstart tiny (hidden 64, 2 layers)'}; median of {repeats} runs of "
              f"{steps} steps (step 1 dropped)")
        for lay in layouts:
            phases = {k: statistics.median(r[k] for r in runs[lay]) for k in PHASES}
            laps = ", ".join(f"{r['seconds_per_step']:.3f}" for r in runs[lay])
            print(f"  klear-rl {lay:14s} {med[lay]:6.3f} s/step  (" + ", ".join(
                f"{k.split('/')[1].removesuffix('_s')} {v:.3f}" for k, v in phases.items())
                + f"; runs {laps})")
        entry: dict = {"klear_seconds_per_step": med}
        if trl:
            tmed = {c: statistics.median(t) for c, t in trl.items()}
            for c, t in trl.items():
                print(f"  TRL {c:19s} {tmed[c]:6.3f} s/step  (runs: "
                      f"{', '.join(f'{x:.3f}' for x in t)})")
            entry["trl_seconds_per_step"] = tmed
            for fmt, klear in SAME_WORK.items():  # each prompt format is its own work
                ours = [c for c in tmed if TRL_CONFIGS[c][2] == fmt]
                if klear not in med or not ours:
                    continue
                fastest = min(ours, key=tmed.get)
                ratio = tmed[fastest] / med[klear]
                entry[f"speedup_vs_trl_{fmt}"] = ratio
                print(f"  {fmt} prompts: klear-rl {klear} is {ratio:.2f}x faster than TRL at its "
                      f"fastest ({fastest}) per RL step (target >= 1.5x)")
        result[name] = entry
    return result


# --------------------------------------------------------------------------- part 3: async

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
            runs[mode].append(klear_step(hf, data, work, prompts, n, max_new, "1rank",
                                         steps, flags))
    med = {m: statistics.median(r["seconds_per_step"] for r in rs) for m, rs in runs.items()}
    print(f"Part 3 [{setting}]: sync vs async, {prompts} prompts x {n} samples, {max_new} new "
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


# The same work per prompt format (chat template, or raw text as the prompt): klear-rl's
# layout at its defaults for it, compared with TRL's fastest configuration of that format.
SAME_WORK = {"chat": "defaults", "raw": "raw-prompts"}
# TRL GRPOTrainer configurations: name -> (gradient-accumulation steps, reward, prompt format
# as in SAME_WORK). "best" is
# TRL's fastest for this work: the whole generation batch (prompts x n) is one training batch
# (per_device_train_batch_size = prompts x n, no accumulation rounds), one generation and one
# optimizer step per RL step (as klear-rl), 2 torch threads (the machine's cores), and the
# reward klear-rl scores with (megatron_klear.rewards.score_batch("math")), so neither side
# pays more for rewards; and in every configuration the worker freezes its start-up heap
# before training, as klear-rl's processes do (megatron_klear.heap). "ga2" is the earlier rounds' configuration (2 accumulation rounds of
# half the batch); "cheap-reward" replaces the verifier by a substring test, TRL's floor;
# "raw-prompts" passes the prompts as plain text, without the chat template (the format of
# the TRL run in issue 32), against klear-rl's "raw-prompts" layout (--prompt-template raw).
TRL_CONFIGS = {"best": (1, "math", "chat"), "ga2": (2, "math", "chat"),
               "cheap-reward": (1, "substring", "chat"), "raw-prompts": (1, "math", "raw")}


def trl_worker(hf: str, prompts: str, num_prompts: int, n: int, max_new: int, steps: int,
               config: str) -> None:
    """TRL's GRPOTrainer in ``config`` (TRL_CONFIGS) on the same setup; prints the mean
    seconds per RL step. Beta 0 (no reference model), loss "dapo" (token-level, as ours)."""
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_klear.heap import freeze_startup_heap
    from megatron_klear.rewards import score_batch

    accumulation, reward_kind, prompt_format = TRL_CONFIGS[config]
    torch.set_num_threads(2)
    ds = load_dataset("json", data_files=prompts, split="train")
    if prompt_format == "chat":  # conversational prompts: the chat template, as klear-rl's
        ds = ds.map(lambda r: {"prompt": [{"role": "user", "content": r["prompt"]}]})

    def reward(completions, answer, **_):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        if reward_kind == "substring":
            return [float(f"\\boxed{{{a}}}" in t) for t, a in zip(texts, answer)]
        return score_batch("math", texts, list(answer))

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(),
                     per_device_train_batch_size=num_prompts * n // accumulation,
                     gradient_accumulation_steps=accumulation, num_generations=n,
                     max_completion_length=max_new, temperature=1.0, beta=0.0, learning_rate=2e-4,
                     loss_type="dapo", max_steps=steps, logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=True, bf16=False, seed=0)
    trainer = GRPOTrainer(model=hf, reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[Clock()])
    freeze_startup_heap()  # as klear-rl's processes do: no full collections over the imports
    start = time.perf_counter()
    trainer.train()
    laps = [b - a for a, b in zip([start] + stamps, stamps)][1:]  # step 1 includes warm-up
    print(json.dumps({"seconds_per_step": sum(laps) / len(laps)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--part", choices=("all", "packing", "trl", "async"), default="all")
    p.add_argument("--layouts", default="defaults,raw-prompts,1srv-2threads,no-share",
                   help=f"klear-rl layouts to time, from {sorted(LAYOUTS)}")
    p.add_argument("--settings", default="bench,held-out", help=f"from {sorted(SETTINGS)}")
    p.add_argument("--trl-configs", default=",".join(TRL_CONFIGS),
                   help=f"TRL configurations to time, from {sorted(TRL_CONFIGS)}")
    args = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores; other jobs slow both sides)")
    work = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    result = {}
    if args.part in ("all", "packing"):
        result.update(packing_part(work, args.repeats))
    if args.part in ("all", "trl"):
        result.update(trl_part(work, args.steps, args.repeats, args.layouts.split(","),
                               args.settings.split(","), args.trl_configs.split(",")))
    if args.part in ("all", "async"):
        result.update(async_part(work, args.steps, args.repeats, args.settings.split(",")[0]))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]), sys.argv[8])
    else:
        main()
