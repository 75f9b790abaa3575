"""klear-rl at its defaults against TRL's GRPOTrainer at its fastest, as an outsider sets it up.

  PYTHONPATH=. python benchmarks/bench_vs_trl.py [--runs 3] [--steps 12] [--sweep 8x32,...]
                                                 [--update-docs]

The setup (issue 42): a tiny Qwen3 (hidden 128, intermediate 256, 4 layers, head_dim 32),
fp32, the project's character tokenizer saved WITHOUT a chat template, so both sides see
plain-text prompts (klear-rl's default on such a tokenizer is ``--prompt-template raw``; TRL
gets a dataset of strings); 16 prompts x 8 samples, 32 new tokens, temperature 1, one
optimizer step per RL step, the same math reward (``score_batch("math")``), LR 2e-4.

* klear-rl: ``torchrun --nproc-per-node 2 -m megatron_klear.train.rl`` with only the work's
  own flags (batch, samples, length, LR, steps) and ``--no-dynamic-sampling`` (TRL neither
  drops zero-advantage groups nor generates more to refill them): no layout or speed flag.
* TRL: one process, 2 torch threads (the machine's cores), one generation batch of
  prompts x n that is one training batch (``per_device_train_batch_size`` = 128,
  ``gradient_accumulation_steps`` 1, so TRL skips its old-log-prob pass as klear-rl does),
  beta 0 (no reference model), loss ``dapo`` (token-level, as klear-rl's). Its remaining
  settings (gradient checkpointing, KV cache) are the candidates of TRL_CANDIDATES, every one
  measured in every held-out run.

Stages, with progress on stderr: (1) ``--runs`` held-out rounds, each klear-rl then every TRL
candidate, each run the median of its steps after the first (warm-up; 12 steps a run: of the 7
laps of 8 steps, two sat at the run's edges -- a second step still faulting pages in, and on
klear-rl's side a last batch whose seeded samples send the math verifier down a 16-60 ms sympy
path -- and moved the median with them); TRL's fastest
configuration is the candidate with the lowest median over the rounds, and each round
compares klear-rl with it (a choice from one short run per candidate flipped with the noise);
(2) the per-phase profile of both sides (from the same runs: klear-rl's ``time/*`` metrics,
TRL's methods timed in its worker); (3) the sweep (``--sweep``, default SWEEP: one run per
side per point, TRL in its fastest configuration); (4) the plot (docs/trl_sweep.png). ``--update-docs``
writes the tables between the markers in docs/results.md. TRL is not a dependency: ``pip install
trl==1.16.0`` (and matplotlib for the plot).
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

from results_doc import write_block  # benchmarks/, the script's folder

ROOT = Path(__file__).resolve().parent.parent
ARCH = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "head_dim": 32,
        "max_position_embeddings": 2048}
PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 32
# the sweep's points, samples per prompt x new tokens (--sweep)
SWEEP = "8x32,8x256,8x1024,32x32"
# TRL generation backends, each a candidate for its fastest on this work: name -> GRPOConfig
# fields beyond the common ones, and why it is a candidate
TRL_CANDIDATES = {
    "defaults": ({}, "GRPOConfig's own settings: gradient checkpointing on (TRL's default), "
                 "model.generate with the dynamic KV cache"),
    "no-checkpointing": ({"gradient_checkpointing": False},
                         "no activation recomputation in backward (the model is tiny, memory "
                         "is no constraint)"),
    "no-checkpointing-static-cache": ({"gradient_checkpointing": False,
                                       "cache_implementation": "static"},
                                      "as no-checkpointing, and a preallocated KV cache "
                                      "(no cache growth per generated token)"),
}
# Not a candidate: use_transformers_continuous_batching (transformers' paged engine) took
# 42 s per held-out step here against 6-9 s for model.generate under the same load.
KLEAR_PHASES = {  # profile row -> klear-rl metric (seconds, rank 0)
    "wait for the batch (generate + score + broadcast)": "time/rollout_s",
    "  within it: generation (servers)": "time/generate_s",
    "  within it: scoring (math reward)": "time/reward_s",
    "old log-probs": "time/old_logprob_s",
    "packing (micro-batches)": "time/pack_s",
    "forward + backward + optimizer": "time/train_s",
    "weight sync": "weight_sync/seconds",
    "probe": "time/probe_s",
}
TRL_PHASES = {
    "  within the next: generation (model.generate)": "generate",
    "  within the next: scoring (math reward)": "reward",
    "generate and score (tokenize, generate, decode, reward, advantages)": "generate_and_score",
    "forward + loss": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_setup(work: Path) -> tuple[Path, Path]:
    """The model (tokenizer without a chat template) and the prompts."""
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    hf = save_tiny_hf_model(work / "hf", seed=0, **ARCH)
    (hf / "chat_template.jinja").unlink(missing_ok=True)  # plain prompts, as the outsider's
    cfg_path = hf / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(tok_cfg))
    return hf, write_arithmetic_data(work / "data")["rl"]


def median_lap(stamps: list[float]) -> float:
    """Median seconds per step, step 1 (warm-up) dropped."""
    laps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(laps)


def klear_run(hf: Path, data: Path, work: Path, n: int, new: int, steps: int) -> dict:
    """One klear-rl run at its defaults: median s/step and median phases (steps 2..)."""
    from megatron_klear.train.metrics import read_metrics

    save = Path(tempfile.mkdtemp(dir=work, prefix="klear_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "-m", "megatron_klear.train.rl", "--hf-checkpoint", str(hf),
           "--prompt-data", str(data), "--rollout-batch-size", str(PROMPTS),
           "--mini-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(n),
           "--rollout-max-response-len", str(new), "--no-dynamic-sampling", "--train-iters",
           str(steps), "--save", str(save), "--no-progress-bar", "--lr", "2e-4"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"klear-rl failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    records = read_metrics(save / "metrics.jsonl")
    rows = records[1:]
    phases = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in KLEAR_PHASES.values()}
    stamps = [records[0]["time"]] + [r["time"] for r in rows]
    resp = statistics.mean(r["rollout/response_len"] for r in rows)
    return {"s": median_lap(stamps), "phases": phases, "response_len": resp}


def trl_run(hf: Path, data: Path, n: int, new: int, steps: int, candidate: str) -> dict:
    """One TRL run in a worker process: median s/step and median phases (steps 2..)."""
    out = subprocess.run([sys.executable, __file__, "--trl-worker", json.dumps(
        {"hf": str(hf), "data": str(data), "n": n, "new": new, "steps": steps,
         "candidate": candidate})], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"TRL {candidate} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trl_worker(spec: dict) -> None:
    """TRL's GRPOTrainer on the setup; prints {"s", "phases", "response_len"} as JSON."""
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_klear.heap import freeze_startup_heap
    from megatron_klear.rewards import score_batch

    torch.set_num_threads(2)
    ds = load_dataset("json", data_files=spec["data"], split="train")  # plain-text prompts

    def reward(completions, answer, **_):
        return score_batch("math", list(completions), list(answer))

    stamps: list[float] = []
    spans: list[dict[str, float]] = [{}]

    def add(name: str, seconds: float) -> None:
        spans[-1][name] = spans[-1].get(name, 0.0) + seconds

    class Clock(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            self.t = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            add("optimizer", time.perf_counter() - self.t)

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())
            spans.append({})

    fields, _ = TRL_CANDIDATES[spec["candidate"]]
    batch = PROMPTS * spec["n"]
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch,
                     gradient_accumulation_steps=1, num_generations=spec["n"],
                     max_completion_length=spec["new"], temperature=1.0, beta=0.0,
                     learning_rate=2e-4, loss_type="dapo", max_steps=spec["steps"],
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                     bf16=False, seed=0, **fields)
    trainer = GRPOTrainer(model=spec["hf"], reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[Clock()])

    def timed(obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                add(name, time.perf_counter() - t)
        setattr(obj, attr, wrapper)

    for attr, name in (("_generate", "generate"), ("_calculate_rewards", "reward"),
                       ("_generate_and_score_completions", "generate_and_score"),
                       ("compute_loss", "forward")):
        timed(trainer, attr, name)
    timed(trainer.accelerator, "backward", "backward")
    freeze_startup_heap()  # as klear-rl's processes do: no full collections over the imports
    stamps.append(time.perf_counter())
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history
               if "completions/mean_length" in h]
    steps = spans[1:-1]  # step 1 includes warm-up; the last entry is empty
    phases = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in TRL_PHASES.values()}
    print(json.dumps({"s": median_lap(stamps[1:]), "phases": phases,
                      "response_len": statistics.mean(lengths[1:]) if lengths[1:] else 0.0}))


def held_out(hf: Path, data: Path, work: Path, runs: int, steps: int,
             names: list[str]) -> list[dict]:
    """``runs`` rounds at the held-out shape: klear-rl, then every TRL candidate of ``names``
    (each round's results; :func:`against_fastest` pairs them)."""
    rounds = []
    for i in range(runs):
        log(f"held-out run {i + 1}/{runs}: klear-rl defaults")
        k = klear_run(hf, data, work, SAMPLES, NEW_TOKENS, steps)
        candidates = {}
        for name in names:
            log(f"held-out run {i + 1}/{runs}: TRL {name} ({TRL_CANDIDATES[name][1]})")
            try:
                candidates[name] = trl_run(hf, data, SAMPLES, NEW_TOKENS, steps, name)
            except RuntimeError as e:
                log(f"  {name} did not run here: {str(e).strip().splitlines()[-1][:200]}")
                continue
            log(f"  {name}: {candidates[name]['s']:.3f} s/step (klear-rl {k['s']:.3f})")
        rounds.append({"klear": k, "trl_candidates": candidates})
    return rounds


def against_fastest(rounds: list[dict]) -> tuple[str, list[dict]]:
    """TRL's fastest configuration (the candidate with the lowest median over the rounds) and
    each round's klear-rl against it: {"klear", "trl", "ratio", "trl_candidates" (s/step)}."""
    names = {n for r in rounds for n in r["trl_candidates"]}
    best = min(names, key=lambda n: statistics.median(
        r["trl_candidates"][n]["s"] if n in r["trl_candidates"] else float("inf")
        for r in rounds))
    pairs = [{"klear": r["klear"], "trl": r["trl_candidates"][best],
              "ratio": r["trl_candidates"][best]["s"] / r["klear"]["s"],
              "trl_candidates": {n: c["s"] for n, c in r["trl_candidates"].items()}}
             for r in rounds]
    return best, pairs


def sweep(hf: Path, data: Path, work: Path, trl: str, first: dict,
          points: list[tuple[int, int]]) -> list[dict]:
    """One run per side at each point (the held-out point reuses ``first``, the first held-out
    round); 4 steps a run, 3 from 1024 new tokens."""
    rows = []
    for n, new in points:
        if (n, new) == (SAMPLES, NEW_TOKENS):
            k, t = first["klear"], first["trl"]
        else:
            steps = 3 if new >= 1024 else 4
            log(f"sweep {n} samples x {new} tokens: klear-rl ({steps} steps)")
            k = klear_run(hf, data, work, n, new, steps)
            log(f"sweep {n} samples x {new} tokens: TRL {trl}")
            t = trl_run(hf, data, n, new, steps, trl)
            log(f"  klear-rl {k['s']:.3f}, TRL {t['s']:.3f}: {t['s'] / k['s']:.2f}x")
        rows.append({"n": n, "new": new, "klear": k, "trl": t, "ratio": t["s"] / k["s"],
                     "tokens": PROMPTS * n * k["response_len"]})
    return rows


def tables(trl: str, pairs: list[dict], rows: list[dict]) -> str:
    """The markdown the docs quote: TRL's candidates, the held-out runs, the profile, the
    sweep."""
    names = [n for n in TRL_CANDIDATES if any(n in p["trl_candidates"] for p in pairs)]
    out = ["| TRL candidate | why | " + " | ".join(f"s/step, run {i}" for i in
                                                  range(1, len(pairs) + 1)) + " |",
           "|---|---|" + "---|" * len(pairs)]
    for name in names:
        times = [p["trl_candidates"].get(name) for p in pairs]
        out.append(f"| `{name}`{' (fastest: lowest median)' if name == trl else ''} | "
                   f"{TRL_CANDIDATES[name][1]} | "
                   + " | ".join("did not run" if t is None else f"{t:.3f}" for t in times) + " |")
    out += ["", f"| held-out run | klear-rl defaults s/step | TRL `{trl}` s/step | "
            "TRL / klear-rl |", "|---|---|---|---|"]
    for i, p in enumerate(pairs, 1):
        out.append(f"| {i} | {p['klear']['s']:.3f} | {p['trl']['s']:.3f} | "
                   f"**{p['ratio']:.2f}x** |")
    out += ["", "| klear-rl phase (rank 0, median over steps and runs) | s | TRL phase | s |",
            "|---|---|---|---|"]
    kp = [(name, statistics.median(p["klear"]["phases"][key] for p in pairs))
          for name, key in KLEAR_PHASES.items()]
    tp = [(name, statistics.median(p["trl"]["phases"][key] for p in pairs))
          for name, key in TRL_PHASES.items()]
    ks, ts = (statistics.median(p[side]["s"] for p in pairs) for side in ("klear", "trl"))
    kp.append(("rest (process, HTTP, Python outside the phases)",
               ks - kp[0][1] - sum(v for n, v in kp[3:])))
    tp.append(("rest (Trainer loop, logging, Python)", ts - sum(v for n, v in tp[2:])))
    kp.append(("**step**", ks))
    tp.append(("**step**", ts))
    for i in range(max(len(kp), len(tp))):
        a = kp[i] if i < len(kp) else ("", None)
        b = tp[i] if i < len(tp) else ("", None)
        out.append(f"| {a[0]} | {'' if a[1] is None else f'{a[1]:.3f}'} | {b[0]} | "
                   f"{'' if b[1] is None else f'{b[1]:.3f}'} |")
    out += ["", "| samples x new tokens | tokens generated per step (klear-rl) | klear-rl "
            "s/step | TRL s/step | TRL / klear-rl |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {PROMPTS} x {r['n']} x {r['new']} | {r['tokens']:.0f} | "
                   f"{r['klear']['s']:.3f} | {r['trl']['s']:.3f} | **{r['ratio']:.2f}x** |")
    ratios = [p["ratio"] for p in pairs]
    out += ["", f"Verdict: held-out TRL / klear-rl {min(ratios):.2f}-{max(ratios):.2f}x over "
            f"{len(ratios)} runs (target >= 1.5x in each: "
            f"{'met' if min(ratios) >= 1.5 else 'not met'})"
            + (f"; the sweep: klear-rl faster at {sum(r['ratio'] > 1 for r in rows)} of "
               f"{len(rows)} points." if rows else ".")]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Step time against tokens generated per step, both sides, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side, label in (("klear", "klear-rl (defaults, 2 ranks)"), ("trl", "TRL GRPOTrainer")):
        for n, marker in ((8, "o-"), (32, "s")):
            pts = sorted((PROMPTS * n * (r[side]["response_len"] or r["klear"]["response_len"]),
                          r[side]["s"]) for r in rows if r["n"] == n)
            ax.plot(*zip(*pts), marker, color="C0" if side == "klear" else "C1",
                    label=f"{label}, {n} samples/prompt")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens generated per RL step (16 prompts; each side's mean length)")
    ax.set_ylabel("seconds per RL step (median)")
    ax.set_title("RL step time vs work (tiny Qwen3, 2 CPU cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="held-out runs (pairs)")
    p.add_argument("--steps", type=int, default=12, help="RL steps per held-out run")
    p.add_argument("--sweep", default=SWEEP, help="samples x new tokens per point, comma-"
                   "separated; '' skips the sweep")
    p.add_argument("--trl-candidates", default=",".join(TRL_CANDIDATES),
                   help=f"TRL configurations to choose from, of {list(TRL_CANDIDATES)}")
    p.add_argument("--update-docs", action="store_true",
                   help="write the tables into docs/results.md and the plot to docs/")
    args = p.parse_args()
    names = args.trl_candidates.split(",")
    if unknown := [n for n in names if n not in TRL_CANDIDATES]:
        p.error(f"--trl-candidates {','.join(unknown)}: choose from {','.join(TRL_CANDIDATES)}")
    try:
        points = [tuple(map(int, x.split("x"))) for x in args.sweep.split(",") if x]
    except ValueError:
        p.error(f"--sweep {args.sweep}: points are SAMPLESxTOKENS, e.g. 8x32,8x256")
    try:
        import trl
    except ImportError:
        p.error("TRL is not installed (pip install trl==1.16.0; it is not a megatron-klear "
                "dependency)")
    start = time.time()
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    hf, data = make_setup(work)
    trl_best, pairs = against_fastest(held_out(hf, data, work, args.runs, args.steps, names))
    rows = sweep(hf, data, work, trl_best, pairs[0], points)
    text = (f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, TRL "
            f"{trl.__version__}, load average {load:.1f} before and {os.getloadavg()[0]:.1f} "
            f"after, {(time.time() - start) / 60:.1f} min in all (`python "
            f"benchmarks/bench_vs_trl.py {' '.join(sys.argv[1:])}`).\n\n"
            + tables(trl_best, pairs, rows))
    print(text)
    if args.update_docs:
        write_block("bench_vs_trl", text)
        if rows:
            plot(rows, ROOT / "docs" / "trl_sweep.png")
    print(json.dumps({"trl": trl_best, "held_out": pairs,
                      "sweep": rows}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        trl_worker(json.loads(sys.argv[2]))
    else:
        main()
