#!/usr/bin/env bash
# GPPO on math for Qwen3-30B-A3B (MoE): trainer on 1 node x 8 GPUs (TP4+SP, EP8), SGLang
# servers on separate nodes (examples/klear_8b/launch_sglang.sh with MODEL=<30B-A3B>
# SERVER_TP=4; with --use-routing-replay also ROUTING_REPLAY=1, which starts them with
# --enable-return-routed-experts). Not run on GPUs here (no GPU lent); --dry-run validates
# the layout, and tests/examples/test_examples_multinode.py runs it on CPU with a tiny Qwen3-MoE,
# EP2 across 2 "nodes".
#   ROLLOUT_URLS="http://r0:30000 ..." bash examples/qwen3_30b_a3b/run_rl.sh
#     (add --dry-run to validate only)
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../common.sh"
OUT=${OUT:-/ckpt/qwen3-30b-a3b}
MODEL=$(model_or_config "${MODEL:-/models/Qwen3-30B-A3B}" "$HERE/hf_config" "$@")
DATA=$(data_or_sample "${MATH_DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
ROLLOUT_URLS=${ROLLOUT_URLS:-http://rollout-0:30000 http://rollout-1:30000}
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/rl.yaml" --hf-checkpoint "$MODEL" \
  --prompt-data "$DATA" --rollout-urls $ROLLOUT_URLS \
  --save "$OUT/rl_math" --export-hf "$OUT/rl_math_hf" "$@"
