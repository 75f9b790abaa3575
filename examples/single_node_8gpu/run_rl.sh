#!/usr/bin/env bash
# GPPO on one 8-GPU node: GPUs 0-3 train (TP4), GPUs 4-7 serve rollouts (2 SGLang servers
# of TP2). MODEL is an HF checkpoint (e.g. the SFT export).
#   MODEL=/ckpt/klear-8b/sft_hf DATA=/data/math_rl.jsonl bash examples/single_node_8gpu/run_rl.sh
# Add --dry-run to validate the config and print its per-GPU memory plan (no GPUs).
# ROLLOUT_URLS="http://host:port ...": use servers already running instead of starting two;
# TRAIN_GPUS=<n>: train on GPUs 0..n-1 (default 4).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../common.sh"
GPUS_PER_NODE=${TRAIN_GPUS:-4}
MODEL=$(model_or_config "${MODEL:-/ckpt/klear-8b/sft_hf}" "$HERE/../klear_8b/hf_config" "$@")
DATA=$(data_or_sample "${DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/klear-8b-1node}
urls=${ROLLOUT_URLS:-}
ENGINE_ARGS=()  # --use-routing-replay needs the engines' routed experts (docs/moe.md)
[[ " $* " == *" --use-routing-replay "* ]] && ENGINE_ARGS+=(--enable-return-routed-experts)
if [[ -z "$urls" && " $* " != *" --dry-run "* ]]; then
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((4 + 2 * i)),$((5 + 2 * i)) "$PYTHON" -m sglang.launch_server \
      --model-path "$MODEL" --tp-size 2 --port $((30000 + i)) --mem-fraction-static 0.85 \
      "${ENGINE_ARGS[@]}" &
    urls="$urls http://127.0.0.1:$((30000 + i))"
  done
  trap 'kill $(jobs -p) 2>/dev/null' EXIT
fi
export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((GPUS_PER_NODE - 1)))
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/../klear_8b/rl_math.yaml" --hf-checkpoint "$MODEL" \
  --pipeline-model-parallel-size 1 --prompt-data "$DATA" --save "$OUT" \
  ${urls:+--rollout-urls $urls} "$@"
