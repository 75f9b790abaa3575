"""The CPU quickstart: tiny Qwen3 -> SFT -> eval -> GPPO RL (TP=2, gloo) -> eval -> report.

  python -m megatron_klear.quickstart --out runs/quickstart [--sglang]

``--sglang``: RL rolls out on a real SGLang 0.5.23 server (from .venv-sglang, built by
tools/setup_sglang_cpu.sh) instead of the embedded server.
``--tools``: the task where the tool matters (issue 40): two-digit multiplication, which the
tiny model cannot do in its head, with the python tool; SFT on noisy tool-use trajectories,
then RL with multi-turn tool rollouts (``klear-rl --tools python``), both evals with the tool.
``--colocate``: RL runs colocated (``klear-rl --colocate``): the embedded server releases its
memory while the trainer trains, the trainer is offloaded while it rolls out, and weights go
over as tensor handles.
``--distill``: on-policy distillation (issue 54) against GPPO from one SFT start: a teacher
(the SFT model after twice the RL steps of GPPO) served by an embedded server, then GPPO
alone, OPD alone (``--use-opd --reward none``) and GPPO + OPD for ``--rl-iters`` steps each,
each arm evaluated every ``--distill-eval-interval`` steps; prints a table (final avg@k
paired against GPPO alone, wall time, steps and seconds to close half the student-teacher
gap; docs/opd.md) and writes summary.json. Resumable: finished stages are kept.

Everything is built locally (model, tokenizer, data); each stage runs the real CLI
(torchrun klear-sft / klear-rl, klear-eval) as a separate process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from megatron_klear.data.synthetic import write_arithmetic_data, write_tool_arithmetic_data
from megatron_klear.models.tiny import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, save_tiny_hf_model

# --tools: a call, the tool's response and the answer fit in the response budget (the
# python tool's output is one number)
TOOL_MAX_TURNS, TOOL_RESPONSE_TOKENS, TOOL_RESPONSE_LEN = 3, 16, 160

# --distill: each arm's klear-rl flags on top of the quickstart's GPPO (rl_args); the arms
# with --use-opd also get the served teacher's URL (λ: klear-rl's --opd-kl-coef default, 1)
DISTILL_ARMS: dict[str, list[str]] = {
    "gppo": [],
    "opd": ["--use-opd", "--reward", "none"],
    "gppo+opd": ["--use-opd"],
}
MIN_TEACHER_GAP_SE = 10.0  # the teacher must beat the student after SFT by this many SEs


def run_logged(cmd: list[str], log: Path) -> None:
    """Run one pipeline stage as a subprocess logging to ``log``; exit with its tail on failure."""
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        sys.exit(f"quickstart: step failed ({proc.returncode}); see {log}:\n"
                 + "".join(log.read_text().splitlines(True)[-30:]))


def torchrun_cmd(nproc: int, module: str, args: list[str]) -> list[str]:
    """The command line of a one-node torchrun of ``module`` on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", module, *args]


def tool_flags(tools: bool) -> list[str]:
    """The python tool and its limits, the same for the quickstart's klear-rl and klear-eval
    (ToolFlags: one set of names and defaults in both CLIs); none without ``tools``."""
    return ["--tools", "python", "--max-turns", str(TOOL_MAX_TURNS),
            "--max-tool-response-tokens", str(TOOL_RESPONSE_TOKENS)] if tools else []


def eval_accuracy(model: Path, data: Path, out: Path, k: int, seed: int,
                  tools: bool = False, name: str = "arith", reward: str = "math",
                  length: int | None = None) -> float:
    """avg@k of ``model`` on the eval set at temperature 1.0 (klear-eval; with ``tools`` the
    model may call the python tool, within the limits of the quickstart's klear-rl
    ``--tools``, and the math reward scores the final answer); its samples are kept in
    ``out/samples.jsonl`` for :func:`rl_gain`. ``name``, ``reward`` and ``length`` (new
    tokens; default the quickstart's) let benchmarks/paper_study.py evaluate its code task."""
    length = length or (TOOL_RESPONSE_LEN if tools else 48)
    run_logged([sys.executable, "-m", "megatron_klear.eval", "--model", str(model),
                "--benchmark", f"{name}={data}@{reward}", "--k", str(k), "--temperature", "1.0",
                "--max-new-tokens", str(length), "--out-dir", str(out), "--seed", str(seed)]
               + tool_flags(tools), out.with_suffix(".log"))
    return json.loads((out / "report.json").read_text())["benchmarks"][name][f"avg@{k}"]


def rl_gain(before: Path, after: Path) -> tuple[float, float]:
    """(gain, standard error) of the eval after RL over the eval before, paired per problem
    (two :func:`eval_accuracy` output dirs)."""
    from megatron_klear.eval.evaluate import paired_gain

    return paired_gain(before / "samples.jsonl", after / "samples.jsonl", "arith")


def sft_args(out: Path, args: argparse.Namespace) -> list[str]:
    """klear-sft flags of the quickstart (TP=2 on 2 CPU ranks)."""
    return ["--hf-checkpoint", str(out / "base_hf"), "--data-path", str(out / "data" / "sft.jsonl"),
            "--tensor-model-parallel-size", "2", "--seq-length", "256", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
            "--train-iters", str(args.sft_iters), "--seed", str(args.seed),
            "--save", str(out / "sft_ckpt"), "--export-hf", str(out / "sft_hf"), "--no-progress-bar"]


def rl_args(out: Path, args: argparse.Namespace, start: Path | None = None,
            iters: int | None = None) -> list[str]:
    """klear-rl flags of the quickstart: GPPO at TP=2, the rest at klear-rl's defaults
    (embedded rollout servers, one per core; each prompt trained once for its 8 samples).
    ``--tools``: the python tool and its limits, 16 prompts a step (a tool call is a sandboxed
    interpreter) and the response budget of a call, its response and the answer.

    ``start`` is the SFT model that RL begins from (default ``out/sft_hf``) and the prompts
    are read from beside it, so several RL runs can share one SFT stage; ``iters`` the
    steps (default ``--rl-iters``)."""
    start = start or out / "sft_hf"
    colocate = ["--colocate"] if getattr(args, "colocate", False) else []
    tools = getattr(args, "tools", False)
    batch, mini, length = (16, 16, TOOL_RESPONSE_LEN) if tools else (32, 16, 48)
    return ["--hf-checkpoint", str(start), "--prompt-data", str(start.parent / "data" / "rl.jsonl"),
            "--tensor-model-parallel-size", "2", "--reward", "math",
            "--rollout-batch-size", str(batch), "--mini-batch-size", str(mini),
            "--n-samples-per-prompt", "8", "--rollout-max-response-len", str(length),
            "--lr", str(args.rl_lr), "--train-iters", str(iters or args.rl_iters),
            "--seed", str(args.seed),
            "--save", str(out / "rl_ckpt"), "--export-hf", str(out / "rl_hf"), "--no-progress-bar"
            ] + colocate + tool_flags(tools)


@contextlib.contextmanager
def _sglang_server(model: Path, log_dir: Path):
    """One real SGLang server on 127.0.0.1 serving ``model`` (fp32, CPU engine): its URL."""
    from megatron_klear.rollout.engine.launcher import (SGLANG_CPU_ARGS, launch_sglang_servers,
                                                        sglang_cpu_env)

    python = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
    if not python.is_file():
        sys.exit(f"quickstart --sglang: {python} is missing; run "
                 "`bash tools/setup_sglang_cpu.sh` first")
    print(f"starting SGLang ({python}) for {model}, log: {log_dir}/server_0.log", flush=True)
    with launch_sglang_servers(model, 1, python=str(python), env=sglang_cpu_env(1),
                               extra_args=SGLANG_CPU_ARGS + ["--dtype", "float32"],
                               log_dir=log_dir, startup_timeout_s=900) as servers:
        yield servers.urls[0]


def _run_dry(runs: list[tuple[str, list[str], str]]) -> None:
    """Each ``(module, argv, label)`` trainer's ``--dry-run`` at 2 ranks, side by side (each
    is one process of imports and arithmetic), reported in order; a rejected config exits
    with the trainer's error."""
    env = dict(os.environ, WORLD_SIZE="2", PYTHONWARNINGS="ignore")
    with ThreadPoolExecutor(len(runs)) as pool:
        procs = list(pool.map(lambda run: subprocess.run(
            [sys.executable, "-m", run[0], *run[1], "--dry-run"], env=env, capture_output=True,
            text=True), runs))
    for (module, _, label), proc in zip(runs, procs):
        if proc.returncode:
            sys.exit(f"quickstart --dry-run: {module}{label} rejected its config:\n"
                     f"{proc.stderr[-2000:]}")
        print(f"{module}{label}: config OK (2 ranks, TP=2)")


@contextlib.contextmanager
def _teacher_server(model: Path, log_dir: Path):
    """``--distill``'s teacher: one embedded server on a free port of 127.0.0.1 serving
    ``model``, stopped on exit; its URL."""
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers

    print(f"starting the teacher server for {model}, log: {log_dir}/server_0.log", flush=True)
    with launch_embedded_servers(model, 1, log_dir=log_dir) as servers:
        yield servers.urls[0]


def _write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, atomically (a temp file beside it, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _stage(done: Path, run: Callable[[], dict]) -> dict:
    """``run()``'s result, kept in ``done``: a finished stage is read back, not rerun, so an
    interrupted ``--distill`` resumes (an unfinished klear-sft / klear-rl resumes from its
    own checkpoint under ``--save``)."""
    if done.exists():
        return json.loads(done.read_text())
    result = run()
    _write_json(done, result)
    return result


def half_gap(student: float, teacher: float, curve: list[dict]) -> dict | None:
    """The first point of ``curve`` (``{"step", "seconds", "accuracy"}`` dicts in step order)
    whose accuracy closes half the gap from ``student`` (after SFT) to ``teacher``, i.e.
    reaches their midpoint; None when no point does ("not reached")."""
    target = student + (teacher - student) / 2
    return next((point for point in curve if point["accuracy"] >= target), None)


def teacher_args(out: Path, args: argparse.Namespace) -> list[str]:
    """klear-rl flags of ``--distill``'s teacher: the quickstart's GPPO from ``out/sft_hf`` for
    ``--teacher-rl-iters`` steps, into ``out/teacher``."""
    return rl_args(out / "teacher", args, start=out / "sft_hf", iters=args.teacher_rl_iters)


def arm_args(out: Path, name: str, args: argparse.Namespace, teacher_url: str) -> list[str]:
    """klear-rl flags of one ``--distill`` arm: the quickstart's GPPO from ``out/sft_hf`` into
    ``out/arms/<name>``, an HF export every ``--distill-eval-interval`` steps, and the arm's
    :data:`DISTILL_ARMS` flags (the teacher at ``teacher_url`` where it distills)."""
    flags = DISTILL_ARMS[name]
    teacher = ["--opd-teacher-urls", teacher_url] if "--use-opd" in flags else []
    return (rl_args(out / "arms" / name, args, start=out / "sft_hf")
            + ["--export-hf-interval", str(args.distill_eval_interval)] + flags + teacher)


def _dry_run_distill(args: argparse.Namespace) -> None:
    """Validate every ``--distill`` config: klear-sft, the teacher's klear-rl and each arm's,
    on the data written aside. The OPD arms' teacher check is real (klear-rl asks the URL for
    /model_info and compares tokenizers): an untrained tiny model, standing in for both the
    SFT model and the teacher, is served for the time of the check."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_arithmetic_data(tmp / "data", seed=args.seed)
        save_tiny_hf_model(tmp / "sft_hf", seed=args.seed, chat_template=CHAT_TEMPLATE)
        with _teacher_server(tmp / "sft_hf", tmp / "logs") as url:
            _run_dry([("megatron_klear.train.sft", sft_args(tmp, args), ""),
                      ("megatron_klear.train.rl", teacher_args(tmp, args), " (teacher)")]
                     + [("megatron_klear.train.rl", arm_args(tmp, name, args, url), f" ({name})")
                        for name in DISTILL_ARMS])


def _eval_stage(model: Path, out: Path, eval_dir: Path, args: argparse.Namespace) -> float:
    """avg@k of ``model`` on the held-out set into ``eval_dir``, kept once done."""
    return _stage(eval_dir.with_suffix(".json"), lambda: {"accuracy": eval_accuracy(
        model, out / "data" / "eval.jsonl", eval_dir, args.eval_k, args.seed)})["accuracy"]


def _timed_run(module: str, argv: list[str], log: Path) -> dict:
    """Run one torchrun stage; its wall seconds and the load average at its end."""
    t0 = time.time()
    run_logged(torchrun_cmd(2, module, argv), log)
    return {"seconds": round(time.time() - t0, 1), "load": round(os.getloadavg()[0], 1)}


def _arm_curve(out: Path, name: str, args: argparse.Namespace, student: float) -> list[dict]:
    """An arm's held-out avg@k after SFT (step 0) and every ``--distill-eval-interval`` steps
    to the last, each with the trainer's seconds to that step (metrics.jsonl ``time``)."""
    from megatron_klear.train.loop import interval_export_dir
    from megatron_klear.train.metrics import read_metrics

    run = out / "arms" / name
    seconds = {m["step"]: m["time"] for m in read_metrics(run / "rl_ckpt" / "metrics.jsonl")}
    steps = list(range(args.distill_eval_interval, args.rl_iters, args.distill_eval_interval))
    curve = [{"step": 0, "seconds": 0.0, "accuracy": student}]
    for step in steps + [args.rl_iters]:
        model = run / "rl_hf" if step == args.rl_iters else interval_export_dir(run / "rl_hf", step)
        curve.append({"step": step, "seconds": seconds[step],
                      "accuracy": _eval_stage(model, out, run / f"eval_step{step}", args)})
    return curve


def _distill_settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("seed", "sft_iters", "rl_iters", "rl_lr", "eval_k",
                                          "teacher_rl_iters", "distill_eval_interval")}


def run_distill(args: argparse.Namespace) -> None:
    """``--distill``: SFT, the teacher (checked >= :data:`MIN_TEACHER_GAP_SE` standard errors
    above the SFT student), the three arms from the SFT model with the teacher served, each
    arm's curve; prints the table and writes ``summary.json``. Resumes an interrupted run of
    the same settings in the same ``--out``."""
    from megatron_klear.eval.evaluate import paired_gain

    out, rl = Path(args.out), "megatron_klear.train.rl"
    settings = _distill_settings(args)
    stamp = out / "distill_settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) != settings:
        print(f"quickstart --distill: --out {out} holds a run with other settings "
              f"({stamp}); pass another --out or delete it", file=sys.stderr)
        sys.exit(2)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    _write_json(stamp, settings)
    t0 = time.time()

    def sft() -> dict:
        save_tiny_hf_model(out / "base_hf", seed=args.seed, chat_template=CHAT_TEMPLATE)
        write_arithmetic_data(out / "data", seed=args.seed)
        return _timed_run("megatron_klear.train.sft", sft_args(out, args), out / "logs" / "sft.log")

    _stage(out / "sft.json", sft)
    student = _eval_stage(out / "sft_hf", out, out / "eval_student", args)
    teacher_run = _stage(out / "teacher.json", lambda: _timed_run(
        rl, teacher_args(out, args), out / "logs" / "teacher_rl.log"))
    teacher = _eval_stage(out / "teacher" / "rl_hf", out, out / "eval_teacher", args)
    samples = {"student": out / "eval_student" / "samples.jsonl",
               "teacher": out / "eval_teacher" / "samples.jsonl"}
    gap, gap_se = paired_gain(samples["student"], samples["teacher"], "arith")
    problems = sum(1 for _ in (out / "data" / "eval.jsonl").open())
    z = gap / gap_se if gap_se else (math.inf if gap > 0 else 0.0)  # no spread: all or none
    print(f"\nstudent after SFT {student:.3f}, teacher (SFT + {args.teacher_rl_iters} GPPO "
          f"steps) {teacher:.3f}: gap {gap:+.3f} +- {gap_se:.3f} = {z:.1f} standard errors "
          f"(avg@{args.eval_k}, {problems} held-out problems, paired per problem)", flush=True)
    if z < MIN_TEACHER_GAP_SE:
        sys.exit(f"quickstart --distill: the teacher is not >= {MIN_TEACHER_GAP_SE:.0f} standard "
                 "errors above the student; raise --teacher-rl-iters")
    todo = [name for name in DISTILL_ARMS if not (out / "arms" / f"{name}.json").exists()]
    needs_teacher = any("--use-opd" in DISTILL_ARMS[name] for name in todo)
    with (_teacher_server(out / "teacher" / "rl_hf", out / "logs" / "teacher_server")
          if needs_teacher else contextlib.nullcontext("")) as url:
        runs = {name: _stage(out / "arms" / f"{name}.json", lambda name=name: _timed_run(
            rl, arm_args(out, name, args, url), out / "logs" / f"rl_{name}.log"))
            for name in DISTILL_ARMS}
    base = out / "arms" / "gppo" / f"eval_step{args.rl_iters}" / "samples.jsonl"
    arms = {}
    for name in DISTILL_ARMS:
        curve = _arm_curve(out, name, args, student)
        final = out / "arms" / name / f"eval_step{args.rl_iters}" / "samples.jsonl"
        gain, gain_se = paired_gain(samples["student"], final, "arith")
        diff, diff_se = paired_gain(base, final, "arith")
        arms[name] = {"flags": DISTILL_ARMS[name], "accuracy": curve[-1]["accuracy"],
                      "gain_over_sft": gain, "gain_over_sft_se": gain_se,
                      "vs_gppo": diff, "vs_gppo_se": diff_se, "rl_seconds": runs[name]["seconds"],
                      "load": runs[name]["load"], "curve": curve,
                      "half_gap": half_gap(student, teacher, curve)}
    summary = {"student_after_sft": student, "teacher": teacher, "teacher_gap": gap,
               "teacher_gap_se": gap_se,
               "teacher_gap_in_standard_errors": z if math.isfinite(z) else None,
               "teacher_rl_seconds": teacher_run["seconds"],
               "half_gap_target": student + (teacher - student) / 2, "arms": arms,
               "settings": settings, "opd_kl_coef": 1.0,
               "eval": f"avg@{args.eval_k} at temperature 1.0 on {problems} held-out problems",
               "seconds_this_invocation": round(time.time() - t0, 1)}
    _write_json(out / "summary.json", summary)
    print(distill_table(summary) + f"\nsummary: {out / 'summary.json'}")


def distill_table(summary: dict) -> str:
    """The markdown table of a ``--distill`` summary: per arm, the final avg@k, its paired
    difference from GPPO alone and gain over SFT, the RL wall time, and the step and trainer
    seconds at which it first closed half the student-teacher gap."""
    rows = [f"half the gap: avg@k >= {summary['half_gap_target']:.3f} (student after SFT "
            f"{summary['student_after_sft']:.3f}, teacher {summary['teacher']:.3f})",
            "| arm | flags | avg@k after RL | vs GPPO alone (paired) | gain over SFT (paired) "
            "| RL wall s | half gap reached at step (trainer s) | curve (step: avg@k) |",
            "|---|---|---|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        reached = arm["half_gap"]
        half = (f"{reached['step']} ({reached['seconds']:.0f} s)" if reached
                else "not reached")
        curve = ", ".join(f"{p['step']}: {p['accuracy']:.3f}" for p in arm["curve"])
        rows.append(f"| {name} | `{' '.join(arm['flags']) or '(GPPO)'}` | {arm['accuracy']:.3f} "
                    f"| {arm['vs_gppo']:+.3f} +- {arm['vs_gppo_se']:.3f} | "
                    f"{arm['gain_over_sft']:+.3f} +- {arm['gain_over_sft_se']:.3f} | "
                    f"{arm['rl_seconds']:.0f} | {half} | {curve} |")
    return "\n".join(rows)


def main() -> None:
    """Run the whole pipeline and print the accuracy before and after RL."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sft-iters", type=int, default=None, help="default 300, 400 with --tools")
    p.add_argument("--rl-iters", type=int, default=40)
    p.add_argument("--rl-lr", type=float, default=2e-4)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the trainer configs (with --distill: all five), then stop")
    p.add_argument("--sglang", action="store_true",
                   help="roll out on a real SGLang server (.venv-sglang), not the embedded one")
    p.add_argument("--colocate", action="store_true",
                   help="colocated RL: trainer and rollout server take turns (klear-rl --colocate)")
    p.add_argument("--tools", action="store_true",
                   help="the task where the python tool matters: two-digit multiplication, "
                        "SFT on noisy tool use, RL and evals with multi-turn tool rollouts")
    p.add_argument("--distill", action="store_true",
                   help="on-policy distillation against GPPO: a served teacher, then GPPO, "
                        "OPD and GPPO + OPD from one SFT start (docs/opd.md)")
    p.add_argument("--teacher-rl-iters", type=int, default=None,
                   help="--distill: the teacher's GPPO steps from the SFT model (default "
                        "2 x --rl-iters)")
    p.add_argument("--distill-eval-interval", type=int, default=10,
                   help="--distill: evaluate each arm every K steps (klear-rl "
                        "--export-hf-interval K)")
    args = p.parse_args()
    args.sft_iters = args.sft_iters or (400 if args.tools else 300)
    if args.distill:
        clash = [f for f in ("tools", "sglang", "colocate") if getattr(args, f)]
        if clash:
            p.error(f"--distill runs the arithmetic task on embedded servers: drop --{clash[0]}")
        if args.distill_eval_interval < 1:
            p.error("--distill-eval-interval must be >= 1")
        args.teacher_rl_iters = args.teacher_rl_iters or 2 * args.rl_iters
        if args.dry_run:
            _dry_run_distill(args)
        else:
            run_distill(args)
        return
    write_data = write_tool_arithmetic_data if args.tools else write_arithmetic_data
    evaluate = functools.partial(eval_accuracy, tools=args.tools)
    out = Path(args.out)
    if args.dry_run:  # the data it would train on, written aside: the dry run checks files
        with tempfile.TemporaryDirectory() as tmp:
            write_data(Path(tmp) / "data", seed=args.seed)
            _run_dry([("megatron_klear.train.sft", sft_args(Path(tmp), args), ""),
                      ("megatron_klear.train.rl", rl_args(Path(tmp), args), "")])
        return
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    t0 = time.time()
    save_tiny_hf_model(out / "base_hf", seed=args.seed,
                       chat_template=TOOL_CHAT_TEMPLATE if args.tools else CHAT_TEMPLATE)
    data = write_data(out / "data", seed=args.seed)
    run_logged(torchrun_cmd(2, "megatron_klear.train.sft", sft_args(out, args)), out / "logs" / "sft.log")
    before = evaluate(out / "sft_hf", data["eval"], out / "eval_before", args.eval_k, args.seed)
    if args.sglang:
        with _sglang_server(out / "sft_hf", out / "logs" / "sglang") as url:
            run_logged(torchrun_cmd(2, "megatron_klear.train.rl", rl_args(out, args) + [
                "--rollout-urls", url]), out / "logs" / "rl.log")
    else:
        run_logged(torchrun_cmd(2, "megatron_klear.train.rl", rl_args(out, args)), out / "logs" / "rl.log")
    after = evaluate(out / "rl_hf", data["eval"], out / "eval_after", args.eval_k, args.seed)
    from megatron_klear.train.plot import plot_metrics

    png = plot_metrics(out / "rl_ckpt" / "metrics.jsonl", out / "rl_dashboard.png")
    gain, se = rl_gain(out / "eval_before", out / "eval_after")
    problems = sum(1 for _ in data["eval"].open())
    summary = {"accuracy_before_rl": before, "accuracy_after_rl": after, "gain": gain,
               "gain_standard_error": se, "gain_in_standard_errors": gain / se if se else None,
               "eval": f"avg@{args.eval_k} at temperature 1.0 on {problems} held-out problems "
                       f"({data['eval']})",
               "dashboard": str(png), "seconds": round(time.time() - t0, 1),
               "rollout": "sglang" if args.sglang else "embedded",
               "colocate": args.colocate, "tools": args.tools}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    z = f"{gain / se:.1f} standard errors" if se else "no spread"
    print(f"\naccuracy (avg@{args.eval_k}, T=1.0, {problems} held-out problems): before RL "
          f"{before:.3f} -> after RL {after:.3f}\ngain {gain:+.3f} +- {se:.3f} (standard error "
          f"of the per-problem difference; {z})\ndashboard: {png}\nsummary: "
          f"{out / 'summary.json'} ({summary['seconds']} s)")


if __name__ == "__main__":
    main()
