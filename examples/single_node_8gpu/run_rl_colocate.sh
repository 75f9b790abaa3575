#!/usr/bin/env bash
# GPPO colocated on one 8-GPU node (klear-rl --colocate; docs/rollout.md "Colocated mode"):
# the trainer (TP4 x DP2) and four SGLang engines (TP2) share all 8 GPUs and take turns --
# the engines release their memory (KV cache, then weights) while the trainer trains, the
# trainer is offloaded to CPU while they roll out, and weights go over as CUDA IPC tensor
# handles. Qwen3-8B, 32K responses, 8 x 80 GB. Not run on a GPU.
#   MODEL=/ckpt/klear-8b/sft_hf DATA=/data/math_rl.jsonl bash examples/single_node_8gpu/run_rl_colocate.sh
# Add --dry-run to validate the config and print the per-GPU plan of both phases (no GPUs).
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../common.sh"
GPUS_PER_NODE=8
MODEL=$(model_or_config "${MODEL:-/ckpt/klear-8b/sft_hf}" "$HERE/../klear_8b/hf_config" "$@")
DATA=$(data_or_sample "${DATA:-/data/klear/math_rl.jsonl}" "$HERE/../data/math_rl_sample.jsonl" "$@")
OUT=${OUT:-/ckpt/klear-8b-1node-colocate}
MEM_FRACTION=0.85  # SGLang's static pool (weights + KV) while the trainer is offloaded
urls=""
ENGINE_ARGS=()  # --use-routing-replay needs the engines' routed experts (docs/moe.md)
[[ " $* " == *" --use-routing-replay "* ]] && ENGINE_ARGS+=(--enable-return-routed-experts)
if [[ " $* " != *" --dry-run "* ]]; then
  for i in 0 1 2 3; do
    # --enable-memory-saver: release/resume through torch_memory_saver (CUDA-only)
    CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)) "$PYTHON" -m sglang.launch_server \
      --model-path "$MODEL" --tp-size 2 --port $((30000 + i)) \
      --mem-fraction-static "$MEM_FRACTION" --enable-memory-saver "${ENGINE_ARGS[@]}" &
    urls="$urls http://127.0.0.1:$((30000 + i))"
  done
  trap 'kill $(jobs -p) 2>/dev/null' EXIT
  for url in $urls; do  # healthy; handed over as launched: the trainer releases them (issue 51)
    until curl -sf "$url/health" >/dev/null; do sleep 5; done
  done
fi
# shellcheck disable=SC2086
launch megatron_klear.train.rl --config "$HERE/../klear_8b/rl_math.yaml" --hf-checkpoint "$MODEL" \
  --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 \
  --colocate --sglang-tp-size 2 --sglang-mem-fraction-static "$MEM_FRACTION" \
  --prompt-data "$DATA" --save "$OUT" \
  ${urls:+--rollout-urls $urls --rollout-engine-memory launched} "$@"
