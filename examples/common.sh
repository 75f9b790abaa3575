#!/usr/bin/env bash
# Shared launch logic of the example scripts (sourced, not run).
#   launch MODULE ARGS...   torchrun over NNODES x GPUS_PER_NODE, or, with --dry-run among
#                           ARGS, one local process that validates the config and prints
#                           its per-GPU memory plan (no GPUs; fails if it does not fit).
#   model_or_config DIR FALLBACK ARGS...
#                           DIR, or with --dry-run and no DIR/config.json here, FALLBACK
#                           (the shipped hf_config/ of the public architecture).
#   data_or_sample FILE SAMPLE ARGS...
#                           FILE, or with --dry-run and no FILE here, SAMPLE (a shipped
#                           examples/data/ file in the same format: the dry run checks that
#                           data files exist and their first records parse).
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

model_or_config() {
  local dir=$1 fallback=$2; shift 2
  if [[ " $* " == *" --dry-run "* && ! -f "$dir/config.json" ]]; then echo "$fallback"
  else echo "$dir"; fi
}

data_or_sample() {
  local file=$1 sample=$2; shift 2
  if [[ " $* " == *" --dry-run "* && ! -f "$file" ]]; then
    echo "dry run: $file is not on this machine; checking $sample instead" >&2; echo "$sample"
  else echo "$file"; fi
}

launch() {
  local module=$1; shift
  if [[ " $* " == *" --dry-run "* ]]; then
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) "$PYTHON" -m "$module" "$@"
  else
    "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
      --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" \
      --master-port "$MASTER_PORT" -m "$module" "$@"
  fi
}
