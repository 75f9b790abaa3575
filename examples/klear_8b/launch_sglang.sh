#!/usr/bin/env bash
# Rollout node: one SGLang server per TP group of GPUs on this node, e.g. 4 servers of TP2.
#   MODEL=/ckpt/klear-8b/sft_hf SERVER_TP=2 bash examples/klear_8b/launch_sglang.sh
# Prints the server URLs; pass them to run_rl_*.sh as ROLLOUT_URLS. --dry-run prints the
# commands without starting anything. ROUTING_REPLAY=1: start them with
# --enable-return-routed-experts, which a trainer run with --use-routing-replay needs.
set -euo pipefail
MODEL=${MODEL:-/ckpt/klear-8b/sft_hf}
SERVER_TP=${SERVER_TP:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
BASE_PORT=${BASE_PORT:-30000}
HOST=${HOST:-$(hostname -I 2>/dev/null | awk '{print $1}')}
PYTHON=${PYTHON:-python}
for ((i = 0; i < GPUS_PER_NODE / SERVER_TP; i++)); do
  gpus=$(seq -s, $((i * SERVER_TP)) $(((i + 1) * SERVER_TP - 1)))
  cmd=(env CUDA_VISIBLE_DEVICES="$gpus" "$PYTHON" -m sglang.launch_server --model-path "$MODEL"
       --tp-size "$SERVER_TP" --host 0.0.0.0 --port $((BASE_PORT + i)) --mem-fraction-static 0.85
       --context-length 40960)
  [[ "${ROUTING_REPLAY:-0}" == 1 ]] && cmd+=(--enable-return-routed-experts)
  if [[ " $* " == *" --dry-run "* ]]; then echo "${cmd[*]}"; else "${cmd[@]}" & fi
  echo "http://$HOST:$((BASE_PORT + i))"
done
[[ " $* " == *" --dry-run "* ]] || wait
