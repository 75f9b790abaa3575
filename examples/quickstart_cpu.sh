#!/usr/bin/env bash
# The CPU quickstart: sets up .venv, then tiny Qwen3 -> SFT -> eval -> GPPO RL (TP=2, gloo)
# -> eval, and prints the accuracy gain and the dashboard path. ~5 minutes on 2 cores.
#   bash examples/quickstart_cpu.sh [--out runs/quickstart] [--dry-run]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ " $* " == *" --dry-run "* && -x .venv/bin/python ]] || bash tools/setup_env.sh
exec .venv/bin/python -m megatron_klear.quickstart "$@"
