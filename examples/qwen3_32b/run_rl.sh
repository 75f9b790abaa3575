#!/usr/bin/env bash
# GPPO on math for Qwen3-32B: trainer on 2 nodes x 8 GPUs (TP8 x DP2), SGLang servers on
# separate nodes (examples/klear_8b/launch_sglang.sh with MODEL=<32B> SERVER_TP=4 or 8).
# Run on every trainer node:
#   NNODES=2 NODE_RANK=<i> MASTER_ADDR=<node0> ROLLOUT_URLS="http://r0:30000 ..." \
#     bash examples/qwen3_32b/run_rl.sh            (add --dry-run to validate only)
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-2}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/qwen3-32b}
MODEL=$(model_or_config "${MODEL:-$OUT/sft_hf}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${MATH_DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-1:30000}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl.yaml" --hf-checkpoint "$MODEL" \
  --load "$OUT/sft" --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --save "$OUT/rl_math" --export-hf "$OUT/rl_math_hf" "$@"
