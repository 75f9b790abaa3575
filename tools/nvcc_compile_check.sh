#!/usr/bin/env bash
# Compile every csrc/**/*.cu with plain nvcc for the targets of csrc/cuda/nvcc_gencode.txt (sm_80
# and sm_90 machine code, compute_90 PTX; the list setup.py builds with) and check that the
# fatbinary embeds that SASS and PTX (the images nvcc --dryrun hands to `fatbinary`: the objects
# are compressed and cuobjdump is not always installed). CI check; no GPU needed. Exits non-zero
# on any failure; skips (exit 0) with a message only when nvcc is absent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v nvcc >/dev/null 2>&1; then
  echo "nvcc_compile_check: SKIPPED - nvcc is not installed (install the CUDA toolkit to run it)"
  exit 0
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mapfile -t gencode < "$root/csrc/cuda/nvcc_gencode.txt"
mapfile -t sources < <(cd "$root" && find csrc -name '*.cu' | sort)
if [ "${#sources[@]}" -eq 0 ]; then
  echo "nvcc_compile_check: no .cu files under csrc/" >&2
  exit 1
fi
for src in "${sources[@]}"; do
  obj="$out/$(echo "$src" | tr '/' '_').o"
  echo "nvcc ${gencode[*]}: $src"
  nvcc -c -O3 -std=c++17 -I"$root/csrc" "${gencode[@]}" "$root/$src" -o "$obj"
  images="$(nvcc --dryrun -c -O3 -std=c++17 -I"$root/csrc" "${gencode[@]}" "$root/$src" \
    -o "$obj" 2>&1 | grep -o 'image3=kind=[a-z]*,sm=[0-9]*' | sort -u | tr '\n' ' ')"
  for want in kind=elf,sm=80 kind=elf,sm=90 kind=ptx,sm=90; do
    grep -q "$want" <<<"$images" ||
      { echo "nvcc_compile_check: $src: no $want image (has: $images)" >&2; exit 1; }
  done
done
echo "nvcc_compile_check: OK (${#sources[@]} file(s), sm_80 + sm_90 SASS, compute_90 PTX," \
  "$(nvcc --version | tail -1))"
