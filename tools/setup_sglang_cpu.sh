#!/usr/bin/env bash
# Create .venv-sglang/ (idempotent): real SGLang 0.5.23, pinned, runnable on this CPU.
# It is separate from .venv because SGLang pins its own transformers; the interop tests
# (tests/interop/) and `examples/quickstart_cpu.sh --sglang` start servers from it.
#   - torch 2.13.0: the same CPU build .venv installs (requirements-ci.txt);
#   - sglang, triton, torchvision without their dependency trees (--no-deps), and the
#     pure-Python packages SGLang needs, pinned in tools/sglang_cpu/requirements-lean.txt;
#   - two stand-ins (tools/sglang_cpu/): an `sgl_kernel` module (only
#     assign_req_to_token_pool_cpu works) and the torchvision::nms/qnms schema declarations,
#     loaded before torchvision by a .pth hook. Each names the real part it stands in for.
# Serve with SGLANG_USE_CPU_ENGINE=1 and --device cpu --attention-backend torch_native
# --disable-cuda-graph --disable-overlap-schedule --max-total-tokens 8192 --sleep-on-idle
# (megatron_klear/rollout/engine/launcher.py: SGLANG_CPU_ARGS). About 70 s and 90 MB to install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
SRC=tools/sglang_cpu
stamp_now=$(cat "$0" "$SRC/requirements-lean.txt" | sha256sum | cut -c1-16)
if [ -f "$VENV/.klear-stamp" ] && [ "$(cat "$VENV/.klear-stamp")" = "$stamp_now" ]; then
  :  # packages already installed by this script version; refresh the stand-ins below
else
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0
  "$VENV/bin/python" -m pip install -q --no-deps sglang==0.5.23 triton==3.8.0 \
      torchvision==0.28.0 -r "$SRC/requirements-lean.txt"
fi
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$SITE/sgl_kernel"
cp -r "$SRC/sgl_kernel" "$SITE/sgl_kernel"
cp "$SRC/klear_torchvision_ops.py" "$SITE/"
echo "import klear_torchvision_ops; klear_torchvision_ops.install()" \
  > "$SITE/klear_torchvision_ops.pth"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang.srt.entrypoints.http_server, \
torch; print('sglang ready:', __import__('sglang').__version__, '| torch', torch.__version__)"
echo "$stamp_now" > "$VENV/.klear-stamp"
