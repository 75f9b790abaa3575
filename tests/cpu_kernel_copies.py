"""Run a check under every lower CPU kernel copy of the extension, one process each:
``KLEAR_CPU_ISA`` caps the copy chosen at run time (read once per process), so a machine with
AVX-512 also runs the AVX2 and baseline (SSE2) copies of every kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def check_every_lower_copy(script: str, timeout_s: float = 600) -> None:
    """Run ``script`` (Python source) once per copy below this machine's best, in parallel,
    and fail naming the copy whose run failed or that ran another copy."""
    import torch  # noqa: F401 - loads the libraries the extension links

    from megatron_klear import _C

    names = _C.cpu_isa_names[:_C.cpu_isa_names.index(_C.cpu_isa())]
    prelude = "import torch\nfrom megatron_klear import _C\nprint(_C.cpu_isa(), flush=True)\n"
    procs = {name: subprocess.Popen([sys.executable, "-c", prelude + script], cwd=ROOT,
                                    text=True, env={**os.environ, "KLEAR_CPU_ISA": name,
                                                    "OMP_NUM_THREADS": "1"},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in names}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"KLEAR_CPU_ISA={name}: {err[-3000:]}"
        assert out.split()[0] == name, f"KLEAR_CPU_ISA={name} ran the {out.split()[0]} copy"
