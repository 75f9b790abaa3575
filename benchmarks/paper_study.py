"""Klear-Reasoner's section 5 analyses as arms x seeds on the CPU quickstart's tasks (issue 53).

  python benchmarks/paper_study.py [--only 5.2.1] [--seeds 4] [--out runs/paper_study] [--dry-run]

Analyses (:data:`ANALYSES`; the paper's claim, the arms, the baseline arm first):

- 5.2.1: ``--loss-type`` gppo against clip-higher (``ppo``: PPO clipping at the Clip-Higher
  bounds 0.2/0.28, DAPO) and cispo;
- 5.2.2: the SFT term's weight ``--sft-alpha`` 0.1 against 0, 0.05 and 0.2;
- 5.2.3: the soft code reward (``--reward code``, the test pass rate) against the hard one
  (``--reward code_hard``) on the toy code task (data/synthetic.py
  :func:`~megatron_klear.data.synthetic.write_code_function_data`), held-out score hard;
- 5.2.5: ``--dynamic-sampling`` (zero-advantage groups dropped and refilled) against
  ``--no-dynamic-sampling``; both train ``--rollout-batch-size`` groups a step for the same
  steps, so the same number of trained samples;
- 5.1.1: SFT on the quickstart's mixed data (40% of the demonstrations box a wrong answer)
  against the same data with those dropped (correct-only), held-out on the easy (one-digit
  product) and hard (two-digit product) problems;
- rl-variants (not run by default): the policy-loss and rollout variants
  benchmarks/compare_rl_variants.py compared before this study absorbed it.

Every run is a real ``klear-rl`` or ``klear-sft`` launch (torchrun, TP=2 on 2 CPU ranks) and
every score a ``klear-eval`` avg@k at T=1.0 on held-out problems, never trained on. For each
seed, the task's tiny Qwen3, data and SFT stage are made once and shared by every arm of
every analysis (RL arms start from that SFT model, with the same prompts and steps). An arm's
command line is its stage's baseline with the analysed setting's flags changed, nothing else
(all other flags are the quickstart's, printed at the start); arms run interleaved within a
seed. Arms with the same settings are one run (the baseline of 5.2.1, 5.2.2 and 5.2.5 is the
same run). A run whose ``result.json`` exists is not redone (written last, atomically), so an
interrupted study resumes.

The paired difference of an arm against the baseline, per split: for seed s and held-out
problem p, d_sp = (arm's mean score on p) - (baseline's mean score on p), both runs from seed
s's SFT model. The difference is the mean of the seeds' means D_s = mean_p d_sp. Two standard
errors: pooled, sd(d_sp over all s, p) / sqrt(S * P) (seeds' problems taken as independent
draws: problem noise), and over seeds, sd(D_s) / sqrt(S) (training noise included; none for
one seed). The verdict uses the larger: *agrees* when the difference is >= 2 SE in the paper's
direction, *disagrees* when >= 2 SE the other way, else *inconclusive*.

Per analysis, DIR/NAME/ holds report.json, table.md and curves.png (per arm, the mean over
seeds of the rollout reward, the periodic held-out accuracy (``--eval-data``, the arm's own
reward: for 5.2.3 the soft arm's curve is a pass rate), entropy and grad norm; SFT: loss and
grad norm).

Budget. Single runs measured 2026-12-06 at baa103c on the 2-core VM while four other sessions
ran (load average 9-18), train + klear-eval seconds; the quiet column scales them by 1/4, the
ratio of the quickstart's four stages here (SFT 81 + eval 51 + RL 155 + eval 71 = 358 s)
to its 90 s pipeline on idle cores (docs/results.md, CPU quickstart):

  run (per seed)                         shared, measured     quiet, estimated
  arith SFT stage (shared) or 5.1.1 arm   81 + 51 s             ~35 s
  arith RL arm (40 steps x 32 prompts)   155-198 + 61-71 s      ~65 s
  code SFT stage (shared)                 99 + 113 s            ~55 s
  code RL arm (16 steps x 8 prompts)     504 + 160 s (load 18)  ~165 s (sandbox-bound)

  analysis at 4 seeds, alone        runs per seed                     quiet, estimated
  5.2.1                             SFT + 3 RL arms                   ~15 min
  5.2.2                             SFT + 4 RL arms                   ~20 min
  5.2.3                             code SFT + 2 code RL arms         ~26 min
  5.2.5                             SFT + 2 RL arms                   ~11 min
  5.1.1                             SFT + 1 SFT arm                   ~5 min
  the study (shared runs once)      2 SFT + 1 SFT arm + 7 RL + 2 code ~60 min

On the shared VM each figure is about 4x (the study: ~4 h), which is why only parts ran here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from megatron_klear.config import OneLineParser
from megatron_klear.data.records_io import write_records, write_text
from megatron_klear.data.synthetic import write_arithmetic_data, write_code_function_data
from megatron_klear.eval.evaluate import problem_means, standard_error
from megatron_klear.models.tiny import save_tiny_hf_model
from megatron_klear.quickstart import eval_accuracy, rl_args, run_logged, sft_args, torchrun_cmd

Flags = tuple[str, ...]
CURVE_POINTS = 4       # held-out accuracy points along an RL run (--eval-interval)


@dataclass(frozen=True)
class Task:
    """A task every arm of an analysis trains and is scored on; the quickstart's settings
    except ``rl_overrides`` (flags replacing the quickstart's klear-rl values)."""

    name: str
    write_data: Callable[..., dict[str, Path]]
    rl_iters: int
    rl_overrides: Flags
    eval_reward: str
    eval_length: int
    curve_problems: int
    curve_k: int
    sft_iters: int = 300
    rl_lr: float = 2e-4
    eval_k: int = 4


TASKS = {
    "arith": Task("arith", write_arithmetic_data, rl_iters=40, rl_overrides=(),
                  eval_reward="math", eval_length=48, curve_problems=64, curve_k=2),
    # the toy code task: every case of every response runs in its own sandbox (~50 ms on a
    # quiet core), so 8 prompts a step for 16 steps, and 48 held-out problems
    "code": Task("code", write_code_function_data, rl_iters=16,
                 rl_overrides=("--rollout-batch-size", "8", "--mini-batch-size", "8",
                               "--rollout-max-response-len", "64"),
                 eval_reward="code_hard", eval_length=64, curve_problems=16, curve_k=2),
}

# The settings the analyses change, at the baseline's values: klear-rl's defaults spelt out,
# so every arm's command line names its value of the analysed setting.
RL_BASELINE: dict[str, Flags] = {"loss": ("--loss-type", "gppo"), "alpha": ("--sft-alpha", "0.1"),
                                 "dynamic sampling": ("--dynamic-sampling",)}
TASK_REWARD = {"arith": ("--reward", "math"), "code": ("--reward", "code")}
SFT_BASELINE: dict[str, Flags] = {"sft data": ("--data-path", "{data}/sft.jsonl")}


@dataclass(frozen=True)
class Arm:
    """One arm: ``flags`` is its value of the analysed setting; ``expect`` the sign of
    (arm - baseline) the paper predicts, per split (0: no claim)."""

    name: str
    flags: Flags
    expect: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Analysis:
    """Arms x seeds of one claim: ``setting`` is the key of the settings the arms change."""

    name: str
    claim: str
    stage: str                      # "rl" or "sft"
    task: str
    setting: str
    arms: tuple[Arm, ...]           # the paper's baseline arm first
    splits: tuple[str, ...] = ("all",)
    default: bool = True            # part of the study when --only is not given

    @property
    def baseline(self) -> Arm:
        """The arm the others are paired against."""
        return self.arms[0]


ANALYSES = {a.name: a for a in (
    Analysis("5.2.1", "GPPO beats GRPO with Clip-Higher and CISPO (AIME24, LCB v5)", "rl",
             "arith", "loss", (Arm("gppo", ("--loss-type", "gppo")),
                               Arm("clip-higher", ("--loss-type", "ppo"), (-1,)),
                               Arm("cispo", ("--loss-type", "cispo"), (-1,)))),
    Analysis("5.2.2", "the SFT term's alpha is best at 0.1", "rl", "arith", "alpha",
             tuple(Arm(f"alpha={a}", ("--sft-alpha", a), (0,) if a == "0.1" else (-1,))
                   for a in ("0.1", "0", "0.05", "0.2"))),
    Analysis("5.2.3", "a soft code reward (pass rate) beats a hard one (LCB v5 61.0 vs 59.2)",
             "rl", "code", "reward", (Arm("soft", ("--reward", "code")),
                                      Arm("hard", ("--reward", "code_hard"), (-1,)))),
    Analysis("5.2.5", "filtering zero-advantage groups gives steadier held-out gains", "rl",
             "arith", "dynamic sampling", (Arm("on", ("--dynamic-sampling",)),
                                           Arm("off", ("--no-dynamic-sampling",), (-1,)))),
    Analysis("5.1.1", "SFT: correct-only data is better on easy problems, mixed on hard ones",
             "sft", "arith", "sft data",
             (Arm("mixed", ("--data-path", "{data}/sft.jsonl")),
              Arm("correct-only", ("--data-path", "{data}/sft_correct.jsonl"), (1, -1))),
             splits=("easy", "hard")),
    Analysis("rl-variants", "(no claim) policy-loss and rollout variants", "rl", "arith", "loss",
             (Arm("gppo", ("--loss-type", "gppo")),
              Arm("ppo-clip (DAPO)", ("--loss-type", "ppo")),
              Arm("cispo", ("--loss-type", "cispo")),
              Arm("gppo+erc", ("--loss-type", "gppo", "--entropy-ratio-clip", "0.05")),
              Arm("gppo async", ("--loss-type", "gppo", "--async-rollout", "--max-staleness",
                                 "1"))), default=False),
)}


# ------------------------------------------------------------------------- command lines
def set_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` with each ``--flag [value]`` of ``flags`` set: a flag already there gets the
    new value in place, another is appended (so no flag appears twice)."""
    out = list(argv)
    i = 0
    while i < len(flags):
        name = flags[i]
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        i += 2 if value is not None else 1
        if name in out:
            if value is not None:
                out[out.index(name) + 1] = value
        else:
            out += [name] + ([value] if value is not None else [])
    return out


def arm_settings(analysis: Analysis, arm: Arm) -> dict[str, Flags]:
    """The run's settings: its stage's baseline with the analysed setting set to ``arm``'s."""
    base = dict(SFT_BASELINE) if analysis.stage == "sft" else \
        {**RL_BASELINE, "reward": TASK_REWARD[analysis.task]}
    return {**base, analysis.setting: arm.flags}


def _slug(settings: dict[str, Flags]) -> str:
    words = [Path(t).name if "/" in t else t.lstrip("-") for f in settings.values() for t in f]
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", "_".join(words))


def _ns(task: Task, seed: int) -> argparse.Namespace:
    return argparse.Namespace(seed=seed, sft_iters=task.sft_iters, rl_iters=task.rl_iters,
                              rl_lr=task.rl_lr)


def task_dir(out: Path, seed: int, task: Task) -> Path:
    """Where a seed's model, data and shared SFT stage of ``task`` live."""
    return out / f"seed{seed}" / task.name


def run_dir(out: Path, seed: int, analysis: Analysis, arm: Arm) -> Path:
    """The run of ``arm`` at ``seed``: one directory per distinct settings, so arms with the
    same settings (in any analysis) are one run; the baseline SFT is the shared SFT stage."""
    settings = arm_settings(analysis, arm)
    tdir = task_dir(out, seed, TASKS[analysis.task])
    if analysis.stage == "sft":
        return tdir if settings == SFT_BASELINE else tdir / "sft" / _slug(settings)
    return tdir / "rl" / _slug(settings)


def sft_command(out: Path, seed: int, task: Task, settings: dict[str, Flags], rdir: Path
                ) -> list[str]:
    """The klear-sft launch of ``settings`` into ``rdir``: the quickstart's SFT flags."""
    tdir = task_dir(out, seed, task)
    flags = [t.format(data=tdir / "data") for f in settings.values() for t in f]
    argv = set_flags(sft_args(rdir, _ns(task, seed)),
                     ["--hf-checkpoint", str(tdir / "base_hf"), *flags])
    return torchrun_cmd(2, "megatron_klear.train.sft", argv)


def rl_command(out: Path, seed: int, task: Task, settings: dict[str, Flags], rdir: Path
               ) -> list[str]:
    """The klear-rl launch of ``settings`` into ``rdir`` from the seed's shared SFT model:
    the quickstart's RL flags, the task's overrides, the held-out curve's periodic eval."""
    tdir = task_dir(out, seed, task)
    curve = ("--eval-data", str(tdir / "data" / "curve.jsonl"),
             "--eval-interval", str(max(1, task.rl_iters // CURVE_POINTS)),
             "--eval-k", str(task.curve_k))
    argv = set_flags(rl_args(rdir, _ns(task, seed), start=tdir / "sft_hf"),
                     [*task.rl_overrides, *curve, *(t for f in settings.values() for t in f)])
    return torchrun_cmd(2, "megatron_klear.train.rl", argv)


def arm_command(out: Path, seed: int, analysis: Analysis, arm: Arm) -> list[str]:
    """The training launch of ``arm`` at ``seed`` (what the runner executes)."""
    task, settings = TASKS[analysis.task], arm_settings(analysis, arm)
    build = sft_command if analysis.stage == "sft" else rl_command
    return build(out, seed, task, settings, run_dir(out, seed, analysis, arm))


# ------------------------------------------------------------------------------- running
def arith_split(prompt: str) -> str:
    """"easy" when the quickstart problem's product ``b*c`` has one digit, else "hard"."""
    m = re.fullmatch(r"What is \d+\+(\d)\*(\d)\?", prompt)
    if not m:
        raise ValueError(f"not a quickstart arithmetic prompt: {prompt!r}")
    return "easy" if int(m[1]) * int(m[2]) < 10 else "hard"


def _correct_only(sft: Path, dest: Path) -> None:
    """The SFT records whose boxed answer is their reasoning's result (the mixed data's
    correct part: 5.1.1's correct-only arm)."""
    boxed = re.compile(r"=(\d+)\.</think> \\boxed\{(\d+)\}")
    write_records(dest, [r for r in map(json.loads, sft.read_text().splitlines())
                         if (m := boxed.search(r["response"])) and m[1] == m[2]])


def prepare_task(out: Path, seed: int, task: Task) -> Path:
    """The seed's tiny model and data of ``task`` (made once): the data dir."""
    tdir = task_dir(out, seed, task)
    data = tdir / "data"
    if (data / "ready").exists():
        return data
    save_tiny_hf_model(tdir / "base_hf", seed=seed)
    paths = task.write_data(data, seed=seed)
    evals = paths["eval"].read_text().splitlines(True)
    write_text(data / "curve.jsonl", "".join(evals[:task.curve_problems]))
    if task.name == "arith":
        _correct_only(paths["sft"], data / "sft_correct.jsonl")
        write_text(data / "splits.json", json.dumps(
            [arith_split(json.loads(x)["prompt"]) for x in evals]))
    write_text(data / "ready", "")
    return data


def ensure_run(out: Path, seed: int, analysis: Analysis, arm: Arm) -> dict:
    """Train (unless ``result.json`` says it is done) and evaluate one arm at one seed."""
    rdir = run_dir(out, seed, analysis, arm)
    done = rdir / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    task = TASKS[analysis.task]
    data = prepare_task(out, seed, task)
    if analysis.stage == "rl":   # the seed's SFT stage every RL arm starts from
        ensure_run(out, seed, SHARED_SFT[task.name], SHARED_SFT[task.name].baseline)
    rdir.mkdir(parents=True, exist_ok=True)
    cmd = arm_command(out, seed, analysis, arm)
    t0 = time.time()
    run_logged(cmd, rdir / "train.log")
    t1 = time.time()
    model = rdir / ("sft_hf" if analysis.stage == "sft" else "rl_hf")
    acc = eval_accuracy(model, data / "eval.jsonl", rdir / "eval", task.eval_k, seed,
                        name=task.name, reward=task.eval_reward, length=task.eval_length)
    result = {"seed": seed, "settings": arm_settings(analysis, arm), "command": cmd,
              "accuracy": acc, "train_s": round(t1 - t0, 1), "eval_s": round(time.time() - t1, 1),
              "load": round(os.getloadavg()[0], 1)}
    write_text(done, json.dumps(result, indent=1))
    return result


# Per task, the seed's shared SFT stage (on the task's mixed data) as a one-arm analysis: the
# same settings as 5.1.1's baseline, so for arith it is that arm's run.
SHARED_SFT = {name: Analysis(f"{name}-sft", "the shared SFT stage", "sft", name, "sft data",
                             (Arm("mixed", SFT_BASELINE["sft data"]),), default=False)
              for name in TASKS}


# ------------------------------------------------------------------------------ analysing
@dataclass
class Paired:
    """An arm's paired difference against the baseline (see the module docstring)."""

    diff: float
    se_pooled: float
    se_seeds: float
    seeds: int
    problems: int
    per_seed: list[float] = field(default_factory=list)

    @property
    def se(self) -> float:
        """The larger of the two standard errors: the one the verdict uses."""
        return max(self.se_pooled, self.se_seeds)


def paired_difference(pairs: Sequence[tuple[Path, Path, set[int] | None]], benchmark: str
                      ) -> Paired:
    """Over seeds: each ``(baseline samples.jsonl, arm samples.jsonl, problems)`` holds one
    seed's two evals of the same problems; ``problems`` (None: all) is the split."""
    diffs, seed_means = [], []
    for base, arm, keep in pairs:
        b, a = problem_means(base, benchmark), problem_means(arm, benchmark)
        if b.keys() != a.keys():
            raise ValueError(f"{base} and {arm} hold different problems of {benchmark!r}")
        d = [a[p] - b[p] for p in sorted(b) if keep is None or p in keep]
        diffs += d
        seed_means.append(statistics.mean(d))
    return Paired(statistics.mean(seed_means), standard_error(diffs), standard_error(seed_means),
                  len(seed_means), len(diffs), seed_means)


def verdict(diff: float, se: float, expect: int) -> str:
    """agrees / disagrees (>= 2 SE in / against the paper's direction ``expect``) or
    inconclusive; with no claim (``expect`` 0), differs (>= 2 SE) or inconclusive."""
    if se == 0 or abs(diff) < 2 * se:
        return "inconclusive"
    if expect == 0:
        return "differs"
    return "agrees" if diff * expect > 0 else "disagrees"


def _split_problems(out: Path, seed: int, analysis: Analysis, split: str) -> set[int] | None:
    if split == "all":
        return None
    splits = json.loads((task_dir(out, seed, TASKS[analysis.task]) / "data" / "splits.json")
                        .read_text())
    return {i for i, s in enumerate(splits) if s == split}


def _samples(out: Path, seed: int, analysis: Analysis, arm: Arm) -> Path:
    return run_dir(out, seed, analysis, arm) / "eval" / "samples.jsonl"


def _metrics_path(out: Path, seed: int, analysis: Analysis, arm: Arm) -> Path:
    ckpt = "sft_ckpt" if analysis.stage == "sft" else "rl_ckpt"
    return run_dir(out, seed, analysis, arm) / ckpt / "metrics.jsonl"


def _mean_grad_norm(out: Path, analysis: Analysis, arm: Arm, seeds: Sequence[int]
                    ) -> float | None:
    """The arm's grad norm, mean over steps and seeds (5.2.1 claims 0.05-0.08 for each
    loss); None where no metrics were written."""
    from megatron_klear.train.metrics import read_metrics

    norms = [r["grad_norm"] for s in seeds if _metrics_path(out, s, analysis, arm).exists()
             for r in read_metrics(_metrics_path(out, s, analysis, arm))
             if isinstance(r.get("grad_norm"), (int, float))]
    return statistics.mean(norms) if norms else None


def analyse(out: Path, analysis: Analysis, seeds: Sequence[int]) -> list[dict]:
    """One row per (arm, split): avg@k (mean over seeds, and per seed), and for the arms
    but the baseline the paired difference, its SEs and the verdict."""
    name = TASKS[analysis.task].name
    rows = []
    for j, split in enumerate(analysis.splits):
        keep = {s: _split_problems(out, s, analysis, split) for s in seeds}
        for arm in analysis.arms:
            per_seed = []
            for s in seeds:
                means = problem_means(_samples(out, s, analysis, arm), name)
                per_seed.append(statistics.mean(v for p, v in means.items()
                                                if keep[s] is None or p in keep[s]))
            row = {"analysis": analysis.name, "arm": arm.name, "split": split,
                   "flags": " ".join(arm.flags).replace("{data}/", ""),
                   "avg": statistics.mean(per_seed), "avg_per_seed": per_seed,
                   "grad_norm": _mean_grad_norm(out, analysis, arm, seeds)}
            if arm is not analysis.baseline:
                pd = paired_difference([(_samples(out, s, analysis, analysis.baseline),
                                         _samples(out, s, analysis, arm), keep[s])
                                        for s in seeds], name)
                row.update(diff=pd.diff, se_pooled=pd.se_pooled, se_seeds=pd.se_seeds,
                           se=pd.se, problems=pd.problems, diff_per_seed=pd.per_seed,
                           expect=arm.expect[j],
                           verdict=verdict(pd.diff, pd.se, arm.expect[j]))
            rows.append(row)
    return rows


def table(analysis: Analysis, rows: list[dict]) -> str:
    """Markdown rows of ``rows`` (the study's table, one analysis)."""
    lines = []
    for r in rows:
        per = ", ".join(f"{a:.3f}" for a in r["avg_per_seed"])
        if "diff" in r:
            direction = {1: "arm > baseline", -1: "arm < baseline", 0: "no claim"}[r["expect"]]
            vs = (f"{r['diff']:+.3f} +- {r['se']:.3f} (pooled {r['se_pooled']:.3f}, seeds "
                  f"{r['se_seeds']:.3f}) | {direction} | **{r['verdict']}**")
        else:
            vs = "baseline | | "
        norm = "" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        lines.append(f"| {analysis.name} | {r['arm']} (`{r['flags']}`) | {r['split']} | "
                     f"{r['avg']:.3f} ({per}) | {vs} | {norm} |")
    return "\n".join(lines)


TABLE_HEAD = ("| analysis | arm (flags) | held-out split | avg@k, mean over seeds (per seed) | "
              "arm - baseline +- SE | the paper's direction | verdict | grad norm |\n"
              "|---|---|---|---|---|---|---|---|")
RL_CURVES = ("rollout/reward_mean", "eval/avg@{k}", "train/entropy", "grad_norm")
SFT_CURVES = ("loss", "grad_norm")


def plot_curves(out: Path, analysis: Analysis, seeds: Sequence[int], png: Path) -> Path:
    """Per metric a panel, per arm a line: the mean over seeds at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_klear.train.metrics import read_metrics

    task = TASKS[analysis.task]
    keys = [k.format(k=task.curve_k) for k in
            (SFT_CURVES if analysis.stage == "sft" else RL_CURVES)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for arm in analysis.arms:
        records = [read_metrics(_metrics_path(out, s, analysis, arm)) for s in seeds]
        for ax, key in zip(axes[0], keys):
            by_step: dict[int, list[float]] = {}
            for recs in records:
                for r in recs:
                    if isinstance(r.get(key), (int, float)):
                        by_step.setdefault(r["step"], []).append(r[key])
            steps = sorted(by_step)
            ax.plot(steps, [statistics.mean(by_step[s]) for s in steps], marker=".",
                    label=arm.name)
    for ax, key in zip(axes[0], keys):
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"{analysis.name}: {analysis.claim} (mean over {len(seeds)} seeds)", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png)
    return png


def print_fixed_settings(out: Path, analyses: Sequence[Analysis]) -> None:
    """The baseline command line of each stage the analyses launch (seed 1): every flag but
    the analysed one is held at these, the quickstart's, values."""
    print("Held fixed at the quickstart's settings (baseline launches, seed 1; each arm "
          "changes only its analysis' setting):")
    for analysis in analyses:
        cmd = arm_command(out, 1, analysis, analysis.baseline)
        print(f"  {analysis.name} [{analysis.stage}, {analysis.task}]: {' '.join(cmd[2:])}")
    print(flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Run every unfinished (seed, arm) of the chosen analyses, then report each analysis."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=list(ANALYSES), help="run this analysis alone")
    p.add_argument("--seeds", type=int, default=4, help="seeds per arm: 1..N (default 4)")
    p.add_argument("--out", default="runs/paper_study")
    p.add_argument("--dry-run", action="store_true",
                   help="print every launch's command line, run nothing")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    out = Path(args.out).resolve()
    chosen = [ANALYSES[args.only]] if args.only else [a for a in ANALYSES.values() if a.default]
    seeds = list(range(1, args.seeds + 1))
    print_fixed_settings(out, chosen)
    if args.dry_run:
        for analysis in chosen:
            for seed in seeds:
                for arm in analysis.arms:
                    print(f"{analysis.name} seed {seed} {arm.name}: "
                          f"{' '.join(arm_command(out, seed, analysis, arm))}")
        return
    t0 = time.time()
    report = []
    for analysis in chosen:
        t = time.time()
        for seed in seeds:
            for arm in analysis.arms:   # interleaved: load hits the arms of a seed alike
                ensure_run(out, seed, analysis, arm)
        rows = analyse(out, analysis, seeds)
        png = plot_curves(out, analysis, seeds, out / analysis.name / "curves.png")
        k = TASKS[analysis.task].eval_k
        md = table(analysis, rows)
        write_text(out / analysis.name / "report.json", json.dumps(
            {"claim": analysis.claim, "seeds": seeds, "eval_k": k, "rows": rows,
             "curves": str(png), "seconds_this_invocation": round(time.time() - t, 1)}, indent=1))
        write_text(out / analysis.name / "table.md", f"{TABLE_HEAD}\n{md}\n")
        report.append(md)
        print(f"{analysis.name} ({analysis.claim}): {png}", flush=True)
    print(f"\n{TABLE_HEAD}\n" + "\n".join(report))
    print(f"\nwall time of this invocation: {time.time() - t0:.0f} s "
          f"(finished runs are reused, not timed again)")


if __name__ == "__main__":
    sys.exit(main())
