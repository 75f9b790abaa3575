"""Policy-loss and rollout variants compared on the quickstart task: accuracy after RL and wall time.

  python benchmarks/compare_rl_variants.py --seeds 1 2 3 [--variants gppo ppo ...] [--out DIR]

For each seed: the quickstart's tiny Qwen3 and arithmetic data, one SFT stage, then one RL run
per variant from that SFT model with the quickstart's RL flags (TP=2 on 2 ranks, one embedded
rollout server, same seed and budget) plus the variant's flags, then avg@k at T=1.0 on the held
out arithmetic set (256 problems). Variants run interleaved within a seed so machine load hits
them alike. Each gain carries its standard error, paired per problem against the seed's SFT
model; the ranking says which neighbours differ by more than twice the standard error of
their difference, and which cannot be told apart at this budget.
Each finished (seed, variant) is appended to DIR/results.jsonl and skipped when the command is
run again, so an interrupted comparison resumes. Prints the markdown table of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

from megatron_klear.data.synthetic import write_arithmetic_data
from megatron_klear.models.tiny import save_tiny_hf_model
from megatron_klear.eval.evaluate import paired_gain
from megatron_klear.quickstart import eval_accuracy, rl_args, run_logged, sft_args, torchrun_cmd

VARIANTS: dict[str, list[str]] = {
    "gppo": ["--loss-type", "gppo"],
    "ppo-clip (DAPO)": ["--loss-type", "ppo"],
    "cispo": ["--loss-type", "cispo"],
    "gppo+erc": ["--loss-type", "gppo", "--entropy-ratio-clip", "0.05"],
    "gppo async": ["--loss-type", "gppo", "--async-rollout", "--max-staleness", "1"],
}


def _sft_stage(seed_dir: Path, args: argparse.Namespace) -> float:
    """Tiny model, data and SFT for one seed (reused when present); the accuracy before RL."""
    done = seed_dir / "before.json"
    if done.exists():
        return json.loads(done.read_text())["accuracy"]
    (seed_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_tiny_hf_model(seed_dir / "base_hf", seed=args.seed)
    data = write_arithmetic_data(seed_dir / "data", seed=args.seed)
    run_logged(torchrun_cmd(2, "megatron_klear.train.sft", sft_args(seed_dir, args)),
               seed_dir / "logs" / "sft.log")
    acc = eval_accuracy(seed_dir / "sft_hf", data["eval"], seed_dir / "eval_before",
                        args.eval_k, args.seed)
    done.write_text(json.dumps({"accuracy": acc}))
    return acc


def _rl_stage(seed_dir: Path, name: str, args: argparse.Namespace) -> dict:
    """One RL run of ``name`` from the seed's SFT model: accuracy after and RL wall time."""
    run_dir = seed_dir / name.replace(" ", "_").replace("(", "").replace(")", "")
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run_logged(torchrun_cmd(2, "megatron_klear.train.rl",
                            rl_args(run_dir, args, start=seed_dir / "sft_hf") + VARIANTS[name]),
               run_dir / "rl.log")
    seconds = time.time() - t0
    acc = eval_accuracy(run_dir / "rl_hf", seed_dir / "data" / "eval.jsonl", run_dir / "eval_after",
                        args.eval_k, args.seed)
    gain, se = paired_gain(seed_dir / "eval_before" / "samples.jsonl",
                           run_dir / "eval_after" / "samples.jsonl", "arith")
    return {"accuracy": acc, "gain": gain, "gain_se": se, "rl_seconds": round(seconds, 1),
            "load": os.getloadavg()[0]}


def _variant_gain(rows: list[dict]) -> tuple[float, float]:
    """A variant's mean gain over its seeds and that mean's standard error: across seeds when
    there are several (seed noise included), else the one run's paired error."""
    gains = [x["gain"] for x in rows]
    if len(gains) > 1:
        return statistics.mean(gains), statistics.stdev(gains) / math.sqrt(len(gains))
    return gains[0], rows[0]["gain_se"]


def _table(rows: list[dict], names: list[str]) -> str:
    """Markdown: per variant, mean (and each seed's) accuracy before/after RL, the gain and
    its standard error, RL seconds and the load they ran under (wall time compares variants
    only on an otherwise idle machine); then the ranking by gain."""
    out = ["| variant | flags | seeds | avg@k before RL | avg@k after RL (per seed) | "
           "gain +- SE | RL wall s (per seed) | load average at the end (per seed) |",
           "|---|---|---|---|---|---|---|---|"]
    gains = {}
    for name in names:
        r = sorted((x for x in rows if x["variant"] == name and "gain" in x),
                   key=lambda x: x["seed"])
        if not r:
            continue
        gains[name] = _variant_gain(r)
        before = statistics.mean(x["before"] for x in r)
        after = [x["accuracy"] for x in r]
        secs = [x["rl_seconds"] for x in r]
        loads = [x["load"] for x in r]
        out.append(f"| {name} | `{' '.join(VARIANTS[name])}` | {len(r)} | {before:.3f} | "
                   f"{statistics.mean(after):.3f} ({', '.join(f'{a:.3f}' for a in after)}) | "
                   f"{gains[name][0]:+.3f} +- {gains[name][1]:.3f} | {statistics.mean(secs):.0f} "
                   f"({', '.join(f'{s:.0f}' for s in secs)}) | "
                   f"{', '.join(f'{load:.1f}' for load in loads)} |")
    ranked = sorted(gains, key=lambda n: -gains[n][0])
    if not ranked:
        return "\n".join(out)
    out.append("\nRanking by gain: " + " ".join(
        f"{a} {'>' if gains[a][0] - gains[b][0] > 2 * math.hypot(gains[a][1], gains[b][1]) else '~'}"
        for a, b in zip(ranked, ranked[1:])) + f" {ranked[-1]}"
        + "  ('>': apart by more than twice the SE of the difference, taken as if the two were independent, which overstates it; '~': not separable at this budget)")
    return "\n".join(out)


def main() -> None:
    """Run every (seed, variant) not yet in DIR/results.jsonl, then print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/compare_rl_variants")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--sft-iters", type=int, default=300)
    p.add_argument("--rl-iters", type=int, default=40)
    p.add_argument("--rl-lr", type=float, default=2e-4)
    p.add_argument("--eval-k", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    for seed in args.seeds:
        args.seed = seed
        before = _sft_stage(out / f"seed{seed}", args)
        for name in args.variants:
            if any(r["seed"] == seed and r["variant"] == name for r in rows):
                continue
            row = {"seed": seed, "variant": name, "before": before,
                   **_rl_stage(out / f"seed{seed}", name, args)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(_table(rows, args.variants))


if __name__ == "__main__":
    main()
