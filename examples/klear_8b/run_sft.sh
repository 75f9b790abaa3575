#!/usr/bin/env bash
# Stage 1, SFT of Qwen3-8B-Base on 4 nodes x 8 GPUs (TP4 x PP2 x DP4). Run on every node:
#   NNODES=4 NODE_RANK=<i> MASTER_ADDR=<node0> bash examples/klear_8b/run_sft.sh
# Add --dry-run to validate the config and print its per-GPU memory plan on any machine.
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-4}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-8B-Base}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${SFT_DATA:-/data/klear/sft_long_cot.jsonl}" "$HERE/../data/sft_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/klear-8b}
launch megatron_klear.train.sft --config "$HERE/sft.yaml" --hf-checkpoint "$MODEL" \
  --data-path "$DATA" --save "$OUT/sft" --export-hf "$OUT/sft_hf" "$@"
