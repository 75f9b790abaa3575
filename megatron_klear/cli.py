"""Shared entry-point behaviour for the console scripts: clear errors, non-zero exits."""

from __future__ import annotations

import sys
from typing import Any, Callable


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the user's input is wrong (answered with one line and exit 2)."""
    from megatron_klear.checkpoint.convert import ConversionError
    from megatron_klear.checkpoint.hf_bridge import BridgeError
    from megatron_klear.checkpoint.state import CheckpointError
    from megatron_klear.config import ConfigError
    from megatron_klear.data.prompts import DataError

    return (ConfigError, DataError, ConversionError, BridgeError, CheckpointError,
            FileNotFoundError)


def run_main(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a bad-input error prints one clear line and exits with status 2.

    Under torchrun the process (and its process group) ends when the launcher dies.
    """
    from megatron_klear.orphans import exit_with_launcher

    exit_with_launcher()
    errors = bad_input_errors()
    try:
        return fn()
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        _shutdown()


def trainer_main(cfg_cls: type, train: Callable[[Any], Any], argv, prog: str,
                 workload: Callable[[Any], Any] | None = None) -> None:
    """Parse a trainer's flags, then validate only (--dry-run) or train.

    ``workload(cfg)`` gives the :class:`~megatron_klear.train.memory.Workload` (sequence
    length, loss kind) the dry run's memory plan assumes for this trainer.
    """
    from megatron_klear.config import parse_config

    def run():
        cfg = parse_config(cfg_cls, argv, prog=prog)
        if cfg.dry_run:
            from megatron_klear.train.dry_run import dry_run

            return dry_run(cfg, workload(cfg) if workload else None)
        return train(cfg)

    run_main(run)


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
