#!/usr/bin/env bash
# Stage 3, GPPO on code from the math RL checkpoint (same launch as run_rl_math.sh); --finetune
# takes its weights only (step 0, fresh optimizer and prompt cursor) since it is an RL checkpoint too.
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-2}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/klear-8b}
MODEL=$(model_or_config "${MODEL:-$OUT/rl_math_hf}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${CODE_DATA:-/data/klear/code_rl.jsonl}" "$HERE/../data/code_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-0:30001}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl_code.yaml" --hf-checkpoint "$MODEL" \
  --load "$OUT/rl_math" --finetune --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --save "$OUT/rl_code" --export-hf "$OUT/rl_code_hf" "$@"
