"""Shared plumbing of the tools/ CLIs: import path and one error-to-exit-code policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_cli(main: Callable[[], int | None]) -> None:
    """Run ``main``; a bad-input error prints one line naming the problem and exits 2."""
    from megatron_klear.checkpoint.convert import ConversionError
    from megatron_klear.checkpoint.hf_bridge import BridgeError
    from megatron_klear.checkpoint.state import CheckpointError
    from megatron_klear.models.qwen3 import ConfigError

    try:
        code = main()
    except (ConversionError, BridgeError, CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code or 0)
