"""Shared plumbing of the tools/ CLIs: the import path, and the package's error policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_cli(main: Callable[[], int | None]) -> None:
    """Run ``main``; a bad-input error prints one line naming the problem and exits 2."""
    from megatron_klear.cli import run_main

    sys.exit(run_main(main) or 0)
