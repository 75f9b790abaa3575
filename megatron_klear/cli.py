"""Shared entry-point behaviour for the console scripts: clear errors, non-zero exits."""

from __future__ import annotations

import sys
from typing import Any, Callable


def run_main(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a bad-input error prints one clear line and exits with status 2."""
    from megatron_klear.config import ConfigError

    bad_input: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError)
    try:
        from megatron_klear.data.prompts import DataError

        bad_input += (DataError,)
    except ImportError:  # pragma: no cover
        pass
    try:
        return fn()
    except bad_input as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        _shutdown()


def trainer_main(cfg_cls: type, train: Callable[[Any], Any], argv, prog: str) -> None:
    """Parse a trainer's flags, then validate only (--dry-run) or train."""
    from megatron_klear.config import dry_run, parse_config

    def run():
        cfg = parse_config(cfg_cls, argv, prog=prog)
        return dry_run(cfg) if cfg.dry_run else train(cfg)

    run_main(run)


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
