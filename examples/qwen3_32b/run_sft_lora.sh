#!/usr/bin/env bash
# LoRA SFT of Qwen3-32B on 1 node x 8 GPUs (TP8; full fine-tuning: run_sft.sh, 4 nodes):
#   bash examples/qwen3_32b/run_sft_lora.sh          (add --dry-run for the memory plan)
# --save holds the adapters only; --export-hf writes merged full weights and, in its
# peft_adapter/ folder, the adapters for PEFT (docs/lora.md).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../common.sh"
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-32B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${SFT_DATA:-/data/klear/sft_long_cot.jsonl}" "$HERE/../data/sft_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/qwen3-32b}
launch megatron_klear.train.sft --config "$HERE/sft_lora.yaml" --hf-checkpoint "$MODEL" \
  --data-path "$DATA" --save "$OUT/sft_lora" --export-hf "$OUT/sft_lora_merged_hf" "$@"
