#!/usr/bin/env bash
# Download, on a machine with registry access, the wheels an offline GPU box needs to run
# tools/gpu_check.sh (issue 38): the stock image there has Python 3.12, torch 2.11.0+cu130,
# nvcc 13.0, transformers 5.17 and pytest, and nothing else of ours (no TE, no SGLang, no
# network). What megatron-klear imports at run time beyond that image:
#   megatron-core 0.16.1 (its own needs, torch, numpy and packaging, come with the image);
#   aiohttp and its needs (rollout client and the embedded server);
#   math-verify, latex2sympy2_extended, antlr4 runtime (the math reward; sympy comes with torch);
#   psutil (tests' process helpers), ninja (the extension's build), pytest-timeout (pytest.ini
#   sets `timeout`).
# Not downloaded, because nothing on the check's path imports them: tensorboard (optional in
# train/metrics.py), matplotlib (tools/plot_metrics.py), pyarrow (parquet prompt files only).
#
#   bash tools/gpu_wheels.sh [DIR]          (default DIR: .whl/ in the repository root)
#
# Python 3.12 manylinux x86_64 wheels only, no dependencies resolved (each pinned here, the
# versions the CPU suite runs with); the folder must stay under 16 MiB (the total is printed;
# exit 1 above it). Copy the folder and the repository to the GPU box, then run
# tools/gpu_check.sh there (it installs them with pip --no-index --no-deps --target).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$(realpath -m "${1:-$root/.whl}")"
limit_mib=16
WHEELS=(
  megatron-core==0.16.1
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  psutil==7.2.2 ninja==1.13.2 pytest-timeout==2.4.0
)
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --dest "$dest" "${WHEELS[@]}"
ls -l "$dest"/*.whl
bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
printf 'gpu_wheels: %d wheels, %.1f MiB in %s (limit %d MiB)\n' \
  "$(ls "$dest"/*.whl | wc -l)" "$(echo "$bytes / 1048576" | bc -l)" "$dest" "$limit_mib"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_wheels: the folder is over $limit_mib MiB" >&2
  exit 1
fi
