"""Check a GPU install made with README.md's recipe (issue 38, defect 8).

    python tools/check_gpu_install.py [--constraints constraints-gpu.txt]

Every package pinned in the constraints file is installed at its pin (a later ``pip install``
that replaced torch under the built extensions shows here), ``megatron_klear._C`` imports
with its CUDA kernels, and Transformer Engine's torch extension imports. One line per
problem; exit 1 when there is any, 0 when the install is the recipe's.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pins(path: Path) -> dict[str, str]:
    """{package: version} of the ``name==version`` lines of a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, ver = spec.split("==", 1)
            out[name.strip()] = ver.strip()
    return out


def problems(constraints: Path) -> list[str]:
    found = []
    for name, want in pins(constraints).items():
        try:
            have = version(name)
        except PackageNotFoundError:
            found.append(f"{name}: not installed ({constraints.name} pins {want})")
            continue
        if have.split("+")[0] != want:
            found.append(f"{name}: {have} installed, {constraints.name} pins {want} (reinstall "
                         "in the README's order)")
    import torch  # noqa: F401 - the extensions link against its libraries

    for module, what in (("megatron_klear._C", "our extension"),
                         ("transformer_engine.pytorch", "Transformer Engine's torch extension")):
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - an ABI mismatch raises ImportError or OSError
            found.append(f"{module} ({what}) does not import: {type(exc).__name__}: {exc} "
                         "(rebuild it against the installed torch with --no-build-isolation)")
            continue
        if module == "megatron_klear._C" and not mod.with_cuda:
            found.append("megatron_klear._C was built without CUDA (CUDA_HOME / nvcc missing at "
                         "build time): pip install --no-build-isolation -e . again")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--constraints", type=Path, default=ROOT / "constraints-gpu.txt")
    args = ap.parse_args(argv)
    if not args.constraints.is_file():
        print(f"--constraints {args.constraints}: no such file", file=sys.stderr)
        return 2
    found = problems(args.constraints)
    for line in found:
        print(f"check_gpu_install: {line}", file=sys.stderr)
    if not found:
        import torch

        print(f"check_gpu_install: OK (torch {torch.__version__}, CUDA {torch.version.cuda}; "
              "megatron_klear._C with CUDA kernels; Transformer Engine imports)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
