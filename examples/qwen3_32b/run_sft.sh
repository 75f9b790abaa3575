#!/usr/bin/env bash
# SFT of Qwen3-32B on 4 nodes x 8 GPUs (TP8 x PP2 x DP2). Run on every node:
#   NNODES=4 NODE_RANK=<i> MASTER_ADDR=<node0> bash examples/qwen3_32b/run_sft.sh
# Add --dry-run to validate the config and print its per-GPU memory plan on any machine.
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-4}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-32B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${SFT_DATA:-/data/klear/sft_long_cot.jsonl}" "$HERE/../data/sft_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/qwen3-32b}
launch megatron_klear.train.sft --config "$HERE/sft.yaml" --hf-checkpoint "$MODEL" \
  --data-path "$DATA" --save "$OUT/sft" --export-hf "$OUT/sft_hf" "$@"
