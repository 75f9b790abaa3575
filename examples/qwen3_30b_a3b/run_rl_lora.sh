#!/usr/bin/env bash
# GPPO on math for Qwen3-30B-A3B (MoE) with LoRA on the attention: trainer on 4 GPUs
# (TP4+SP, EP4; full fine-tuning: run_rl.sh, 8 GPUs with CPU-offloaded optimizer state),
# SGLang servers on separate nodes. Not run on GPUs here; --dry-run validates and plans.
#   ROLLOUT_URLS="http://r0:30000 ..." bash examples/qwen3_30b_a3b/run_rl_lora.sh
HERE=$(cd "$(dirname "$0")" && pwd)
GPUS_PER_NODE=${GPUS_PER_NODE:-4}  # before common.sh, which defaults it to 8
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/qwen3-30b-a3b}
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-30B-A3B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${MATH_DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-1:30000}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl_lora.yaml" --hf-checkpoint "$MODEL" \
  --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --save "$OUT/rl_math_lora" --export-hf "$OUT/rl_math_lora_hf" "$@"
