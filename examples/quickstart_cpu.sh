#!/usr/bin/env bash
# The CPU quickstart: sets up .venv, then tiny Qwen3 -> SFT -> eval -> GPPO RL (TP=2, gloo)
# -> eval, and prints the accuracy gain and the dashboard path. ~5 minutes on 2 cores.
#   bash examples/quickstart_cpu.sh [--out runs/quickstart] [--dry-run] [--sglang] [--colocate]
#                                   [--tools] [--distill]
# --tools: the task where the python tool matters (two-digit multiplication): SFT on noisy
# tool-use trajectories, RL with multi-turn tool rollouts (klear-rl --tools python), both
# evals with the tool;
# --distill: on-policy distillation (issue 54): a teacher (SFT + 2x the GPPO steps) served by
# an embedded server; GPPO, OPD and GPPO + OPD from one SFT start; docs/opd.md;
# --sglang: RL rolls out on a real SGLang 0.5.23 server (.venv-sglang, set up here) instead of
# the embedded server; --colocate: RL in colocated mode (klear-rl --colocate); see README.md
# for how long each variant takes.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ " $* " == *" --dry-run "* && -x .venv/bin/python ]] || bash tools/setup_env.sh
[[ " $* " != *" --sglang "* || " $* " == *" --dry-run "* ]] || bash tools/setup_sglang_cpu.sh
exec .venv/bin/python -m megatron_klear.quickstart "$@"
