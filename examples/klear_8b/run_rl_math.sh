#!/usr/bin/env bash
# Stage 2, GPPO on math: trainer on 2 nodes x 8 GPUs (TP4 x PP2 x DP2), SGLang servers on
# separate nodes (see launch_sglang.sh). Run on every trainer node:
#   NNODES=2 NODE_RANK=<i> MASTER_ADDR=<node0> ROLLOUT_URLS="http://r0:30000 ..." \
#     bash examples/klear_8b/run_rl_math.sh            (add --dry-run to validate only)
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-2}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/klear-8b}
MODEL=$(model_or_config "${MODEL:-$OUT/sft_hf}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${MATH_DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
EVAL=$(data_or_sample "${EVAL_DATA:-/data/klear/aime24.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-0:30001}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl_math.yaml" --hf-checkpoint "$MODEL" \
  --load "$OUT/sft" --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --eval-data "$EVAL" --save "$OUT/rl_math" \
  --export-hf "$OUT/rl_math_hf" "$@"
