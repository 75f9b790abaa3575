#!/usr/bin/env bash
# GPU checks of the fused policy loss (issue 4), for a machine with a CUDA GPU and CUDA torch:
#   1. nvcc compile check (sm_80, sm_90) of csrc/**/*.cu;
#   2. build the extension with CUDA (python setup.py build_ext --inplace);
#   3. the parity tests, where the `cuda` backend joins the `cpu` one (TP=1; the TP=2 and DP=2
#      tests use gloo on CPU and run in the CPU suite);
#   4. the benchmark on the GPU (bandwidth column vs 4.8 TB/s);
#   5. with 2+ GPUs, tests/gpu/smoke_2gpu.py (issue 13's GPU path; never run yet).
# Everything is written to the log (default: gpu_checks.log in the repository root; pass a path
# as $1). Copy the log into docs/policy_loss.md. Exits non-zero at the first failing step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
log="$(realpath -m "${1:-$root/gpu_checks.log}")"
cd "$root"
exec > >(tee "$log") 2>&1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda);
sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else
         "run_gpu_checks: needs CUDA torch and a visible GPU")'

step "nvcc compile check"
tools/nvcc_compile_check.sh

step "build the extension with CUDA"
rm -f megatron_klear/_C*.so
python setup.py build_ext --inplace
python -c 'from megatron_klear import _C; import sys;
sys.exit(0 if _C.with_cuda else "run_gpu_checks: _C was built without CUDA (nvcc/CUDA_HOME?)")'

step "parity tests (cpu + cuda backends vs the torch reference)"
python -m pytest -q --timeout 900 tests/test_losses.py tests/test_advantages.py \
  tests/test_policy_loss_op.py

step "benchmark"
python benchmarks/bench_policy_loss.py --device cuda --tokens 1024 4096 16384 \
  --vocab 37984 151936 --repeats 5 --max-gib 100

step "2-GPU smoke test of the GPU path: TE spec, TP2+SP, recompute, distributed optimizer"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --nproc-per-node 2 tests/gpu/smoke_2gpu.py
else
  echo "skipped: fewer than 2 GPUs visible"
fi

step "done: all GPU checks passed; log at $log"
