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

Everything is built locally (model, tokenizer, data); each stage runs the real CLI
(torchrun klear-sft / klear-rl, klear-eval) as a separate process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_klear.data.synthetic import write_arithmetic_data, write_tool_arithmetic_data
from megatron_klear.models.tiny import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, save_tiny_hf_model

# --tools: a call, the tool's response and the answer fit in the response budget (the
# python tool's output is one number)
TOOL_MAX_TURNS, TOOL_RESPONSE_TOKENS, TOOL_RESPONSE_LEN = 3, 16, 160


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


def rl_args(out: Path, args: argparse.Namespace, start: Path | None = None) -> list[str]:
    """klear-rl flags of the quickstart: GPPO at TP=2, the rest at klear-rl's defaults
    (embedded rollout servers, one per core; each prompt trained once for its 8 samples).
    ``--tools``: the python tool and its limits, 16 prompts a step (a tool call is a sandboxed
    interpreter) and the response budget of a call, its response and the answer.

    ``start`` is the SFT model that RL begins from (default ``out/sft_hf``) and the prompts
    are read from beside it, so several RL runs can share one SFT stage."""
    start = start or out / "sft_hf"
    colocate = ["--colocate"] if getattr(args, "colocate", False) else []
    tools = getattr(args, "tools", False)
    batch, mini, length = (16, 16, TOOL_RESPONSE_LEN) if tools else (32, 16, 48)
    return ["--hf-checkpoint", str(start), "--prompt-data", str(start.parent / "data" / "rl.jsonl"),
            "--tensor-model-parallel-size", "2", "--reward", "math",
            "--rollout-batch-size", str(batch), "--mini-batch-size", str(mini),
            "--n-samples-per-prompt", "8", "--rollout-max-response-len", str(length),
            "--lr", str(args.rl_lr), "--train-iters", str(args.rl_iters), "--seed", str(args.seed),
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


def _run_dry(module: str, argv: list[str]) -> None:
    env = dict(os.environ, WORLD_SIZE="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", module, *argv, "--dry-run"], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"quickstart --dry-run: {module} rejected its config:\n{proc.stderr[-2000:]}")
    print(f"{module}: config OK (2 ranks, TP=2)")


def main() -> None:
    """Run the whole pipeline and print the accuracy before and after RL."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sft-iters", type=int, default=None, help="default 300, 400 with --tools")
    p.add_argument("--rl-iters", type=int, default=40)
    p.add_argument("--rl-lr", type=float, default=2e-4)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--dry-run", action="store_true", help="validate both trainer configs, then stop")
    p.add_argument("--sglang", action="store_true",
                   help="roll out on a real SGLang server (.venv-sglang), not the embedded one")
    p.add_argument("--colocate", action="store_true",
                   help="colocated RL: trainer and rollout server take turns (klear-rl --colocate)")
    p.add_argument("--tools", action="store_true",
                   help="the task where the python tool matters: two-digit multiplication, "
                        "SFT on noisy tool use, RL and evals with multi-turn tool rollouts")
    args = p.parse_args()
    args.sft_iters = args.sft_iters or (400 if args.tools else 300)
    write_data = write_tool_arithmetic_data if args.tools else write_arithmetic_data
    evaluate = functools.partial(eval_accuracy, tools=args.tools)
    out = Path(args.out)
    if args.dry_run:  # the data it would train on, written aside: the dry run checks files
        with tempfile.TemporaryDirectory() as tmp:
            write_data(Path(tmp) / "data", seed=args.seed)
            for module, argv in (("megatron_klear.train.sft", sft_args(Path(tmp), args)),
                                 ("megatron_klear.train.rl", rl_args(Path(tmp), args))):
                _run_dry(module, argv)
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
