#!/usr/bin/env bash
# Create .venv (idempotent) with the pinned CPU stack and megatron-klear installed editable,
# which builds the C++ extension. GPU users: pip install --no-build-isolation -e .[gpu].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -r requirements-ci.txt
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
.venv/bin/python -c "import megatron_klear, torch, megatron.core; print('megatron-klear ready:', \
'torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
