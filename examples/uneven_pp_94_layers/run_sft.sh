#!/usr/bin/env bash
# SFT of Qwen3-235B-A22B (94 layers, MoE) with uneven pipeline stages (PP4: 24 + 24 + 24 + 22 layers) on
# 4 nodes x 8 GPUs (TP4 x PP4 x DP2). Run on every node:
#   NNODES=4 NODE_RANK=<i> MASTER_ADDR=<node0> MODEL=<hf dir> \
#     bash examples/uneven_pp_94_layers/run_sft.sh
# Add --dry-run to validate the layout and print its per-GPU memory plan on any machine
# (without MODEL it plans the model of hf_config/). Not run on GPUs here.
HERE=$(cd "$(dirname "$0")" && pwd)
NNODES=${NNODES:-4}  # before common.sh, which defaults it to 1
source "$HERE/../common.sh"
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-235B-A22B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${SFT_DATA:-/data/klear/sft_long_cot.jsonl}" "$HERE/../data/sft_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/uneven-pp-94}
launch megatron_klear.train.sft --config "$HERE/sft.yaml" --hf-checkpoint "$MODEL" \
  --data-path "$DATA" --save "$OUT/sft" "$@"
