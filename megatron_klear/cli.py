"""Shared entry-point behaviour for the console scripts: clear errors, non-zero exits.

The bottom of the entry points: klear-eval, the tools/ CLIs and the trainers' entry
(train/main.py) call :func:`run_main`; nothing here imports a trainer.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


class RunHalted(Exception):
    """A run that stops itself for a reason it can name (answered with one line and exit 1):
    e.g. a run that cannot learn (train/learning_signal.py)."""


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the user's input is wrong (answered with one line and exit 2)."""
    from megatron_klear.checkpoint.convert import ConversionError
    from megatron_klear.checkpoint.hf_bridge import BridgeError
    from megatron_klear.checkpoint.state import CheckpointError
    from megatron_klear.config import ConfigError
    from megatron_klear.data.prompts import DataError
    from megatron_klear.rollout.orchestration.client import RoutedExpertsMissing

    # RoutedExpertsMissing: servers started without --enable-return-routed-experts under replay
    return (ConfigError, DataError, ConversionError, BridgeError, CheckpointError,
            RoutedExpertsMissing, FileNotFoundError)


def run_main(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a bad-input error prints one clear line and exits with status 2, a
    :class:`RunHalted` one line and status 1.

    Under torchrun the process (and its process group) ends when the launcher dies.
    """
    from megatron_klear.orphans import exit_with_launcher

    exit_with_launcher()
    errors = bad_input_errors()
    try:
        return fn()
    except errors as exc:
        print("error: " + " ".join(str(exc).split("\n")), file=sys.stderr)  # one line
        sys.exit(2)
    except RunHalted as exc:
        print("error: " + " ".join(str(exc).split("\n")), file=sys.stderr)
        sys.exit(1)
    finally:
        _shutdown()


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
