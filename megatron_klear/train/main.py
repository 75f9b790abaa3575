"""The trainers' entry point: parse the flags, run the pre-flight checks, then the dry run
or the training loop (``klear-rl`` and ``klear-sft`` call :func:`trainer_main`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from megatron_klear.cli import run_main
from megatron_klear.config import TrainConfig, parse_config
from megatron_klear.train.memory import Workload

T = TypeVar("T", bound=TrainConfig)

__all__ = ["load_config", "trainer_main"]


def load_config(cfg_cls: type[T], argv: Sequence[str] | None, prog: str | None = None) -> T:
    """A trainer's config as both paths use it: parsed and validated, checked against the
    launch, the model and the files, its derived values set
    (:func:`~megatron_klear.train.dry_run.preflight`)."""
    from megatron_klear.train.dry_run import preflight

    cfg = parse_config(cfg_cls, argv, prog=prog)
    preflight(cfg)
    return cfg


def trainer_main(cfg_cls: type[TrainConfig], train: Callable[[Any], Any],
                 argv: Sequence[str] | None, prog: str,
                 workload: Callable[[Any], Workload] | None = None) -> None:
    """Parse a trainer's flags (validated), check them against the launch, the model and
    the files (:func:`~megatron_klear.train.dry_run.preflight`, the same for both paths),
    then plan only (``--dry-run``) or train. A bad flag or file exits 2 with one line,
    before anything is built.

    ``workload(cfg)`` gives the :class:`~megatron_klear.train.memory.Workload` (sequence
    length, loss kind) the dry run's memory plan assumes for this trainer.
    """
    from megatron_klear.train.dry_run import dry_run

    def run():
        cfg = load_config(cfg_cls, argv, prog=prog)
        if cfg.dry_run:
            return dry_run(cfg, workload(cfg) if workload else None)
        return train(cfg)

    run_main(run)
