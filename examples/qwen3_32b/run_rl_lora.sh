#!/usr/bin/env bash
# GPPO on math for Qwen3-32B with LoRA: trainer on 4 GPUs (TP4; full fine-tuning:
# run_rl.sh, 2 nodes x 8), continuing the adapters of run_sft_lora.sh on the frozen base,
# SGLang servers on separate nodes (examples/klear_8b/launch_sglang.sh, MODEL=<32B>):
#   ROLLOUT_URLS="http://r0:30000 ..." bash examples/qwen3_32b/run_rl_lora.sh
#     (add --dry-run to validate only)
HERE=$(cd "$(dirname "$0")" && pwd)
GPUS_PER_NODE=${GPUS_PER_NODE:-4}  # before common.sh, which defaults it to 8
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/qwen3-32b}
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-32B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${MATH_DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-1:30000}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl_lora.yaml" --hf-checkpoint "$MODEL" \
  --load "$OUT/sft_lora" --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --save "$OUT/rl_math_lora" --export-hf "$OUT/rl_math_lora_hf" "$@"
