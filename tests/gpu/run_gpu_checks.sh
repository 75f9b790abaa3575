#!/usr/bin/env bash
# GPU checks of the fused policy loss (issues 4 and 16), for a machine with a CUDA GPU and CUDA
# torch. NOT RUN YET: no GPU has been lent to this project so far. Stands alone: python3, torch,
# nvcc and pytest; nothing on the kernel path imports megatron.
#   1. nvcc compile check (sm_80 + sm_90 SASS, compute_90 PTX) of csrc/**/*.cu;
#   2. build the extension with CUDA (python3 setup.py build_ext --inplace);
#   3. the parity tests, where the `cuda` backend joins `cpu` and `cuda-emu` (TP=1; the TP=2 and
#      DP=2 tests use gloo on CPU and run in the CPU suite);
#   4. tests/gpu/kernel_bandwidth.py: rows beyond 2^31 / 2^32 elements vs fp64 at T=32768,
#      V/TP=151,936 bf16, then achieved bandwidth per kernel vs the HBM peak and a measured copy;
#      fails if fwd+bwd is below 85% of the HBM peak on H100/H200 (threshold in that file).
#   5. issue 30's GPU path on one GPU: tests/multiprocess/test_gpu_path.py (the strict virtual-CUDA launch runs
#      on the real device here: weight-sync probe and compare_logits on device ids, weight sync
#      from the GPU trainer to the embedded CPU server over gloo, packed and shared-prompt RL
#      steps, the CUDA loss kernels' dispatch, --optimizer-cpu-offload keeping loaded weights,
#      the converters' model on meta);
#   6. with 2+ GPUs, tests/gpu/smoke_2gpu.py (issue 13's GPU path, needs megatron-core and TE;
#      issue 30: a padded TP2+SP RL step of an odd length, and an HF checkpoint converted by
#      tools/convert_hf_to_megatron.py loaded into the TE model).
#   7. tests/gpu/colocate_smoke.py (issue 31: trainer offload on the GPU, bitwise; with SGLang
#      and torch_memory_saver installed, release/resume and klear-rl --colocate over CUDA IPC).
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
python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda);
sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else
         "run_gpu_checks: needs CUDA torch and a visible GPU")'

step "nvcc compile check"
tools/nvcc_compile_check.sh

step "build the extension with CUDA"
rm -f megatron_klear/_C*.so
python3 setup.py build_ext --inplace
python3 -c 'from megatron_klear import _C; import sys;
sys.exit(0 if _C.with_cuda else "run_gpu_checks: _C was built without CUDA (nvcc/CUDA_HOME?)")'

# -o addopts=: pytest.ini's "-n 2" needs pytest-xdist, which the GPU image lacks
step "parity tests (cpu, cuda-emu and cuda backends vs the torch reference)"
python3 -m pytest -q -o addopts= --timeout 900 tests/unit/test_policy_loss_op.py tests/multiprocess/test_cuda_emu.py

step "kernel bandwidth and rows beyond 2^31 elements (T=32768, V/TP=151936 bf16)"
python3 tests/gpu/kernel_bandwidth.py --tokens 32768 --vocab 151936 --repeats 10

step "issue 30: the GPU path's calls on one GPU (tests/multiprocess/test_gpu_path.py)"
python3 -m pytest -q -o addopts= --timeout 900 tests/multiprocess/test_gpu_path.py

step "2-GPU smoke test of the GPU path: TE spec, TP2+SP, recompute, distributed optimizer"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --nproc-per-node 2 tests/gpu/smoke_2gpu.py
else
  echo "skipped: fewer than 2 GPUs visible"
fi

step "colocated mode: trainer offload on the GPU, SGLang release/resume, klear-rl --colocate"
python3 tests/gpu/colocate_smoke.py

step "done: all GPU checks passed; log at $log"
