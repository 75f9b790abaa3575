"""The loop skeleton both trainers share (``klear-sft``, ``klear-rl``).

A run: the architecture from ``--hf-checkpoint`` (:func:`model_arch`); the engine built and
restored, with the step and the data position a resumed checkpoint saved
(:func:`start_run`); the metrics log (:func:`open_log`); the steps, each logged, with a save
every ``--save-interval`` steps and at the last one, and an HF export every
``--export-hf-interval`` steps before the last (:func:`run_steps`); then the log closed and
the optional HF export of the final model (:func:`finish`). What a step is (a packed SFT
batch; a rollout, its training and the weight sync) is the trainer's ``take_step``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

from megatron_klear.config import TrainConfig
from megatron_klear.heap import freeze_startup_heap
from megatron_klear.models.qwen3 import Qwen3Arch, load_hf_config, qwen3_config_from_hf
from megatron_klear.train.engine import Engine, build_engine, restore_or_init
from megatron_klear.train.metrics import MetricsLogger, wandb_settings


@dataclass
class RunStart:
    """A built, restored engine and where the run resumes."""

    engine: Engine
    step: int        # optimizer steps done (0: a new run)
    position: int    # the data position saved with the checkpoint (0: a new run)


def model_arch(cfg: TrainConfig) -> Qwen3Arch:
    """The model of ``--hf-checkpoint``'s config.json."""
    return qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint))


def start_run(cfg: TrainConfig, arch: Qwen3Arch, position_key: str) -> RunStart:
    """Build the engine, then resume from a checkpoint of this trainer (its step and
    ``extra[position_key]``) or load the initial weights (step 0, position 0)."""
    engine = build_engine(cfg, arch)
    info = restore_or_init(engine)
    step, position = (info.iteration, info.extra[position_key]) if info else (0, 0)
    return RunStart(engine, step, position)


def open_log(cfg: TrainConfig, desc: str, step: int) -> MetricsLogger:
    """The run's metrics log (rank 0 writes; progress bar and wandb as configured)."""
    return MetricsLogger(cfg.log_dir or cfg.save, total_steps=cfg.train_iters, start_step=step,
                         desc=desc, progress=cfg.progress_bar, log_interval=cfg.log_interval,
                         wandb=wandb_settings(cfg))


def save_due(cfg: TrainConfig, step: int) -> bool:
    """A checkpoint is saved after ``step``: every ``--save-interval`` steps and at the last."""
    return bool(cfg.save) and (step == cfg.train_iters or
                               bool(cfg.save_interval and step % cfg.save_interval == 0))


def interval_export_dir(export_hf: str | Path, step: int) -> Path:
    """Where ``--export-hf-interval`` puts the model after ``step``: ``<--export-hf>_step<N>``
    (a sibling of the final export, so evaluating a run's curve needs no checkpoint
    conversion)."""
    export_hf = Path(export_hf)
    return export_hf.with_name(f"{export_hf.name}_step{step}")


def export_due(cfg: TrainConfig, step: int) -> bool:
    """An intermediate HF export follows ``step``: every ``--export-hf-interval`` steps, but
    not the last (:func:`finish` exports that one to ``--export-hf`` itself)."""
    return bool(cfg.export_hf and cfg.export_hf_interval and step < cfg.train_iters
                and step % cfg.export_hf_interval == 0)


def run_steps(cfg: TrainConfig, engine: Engine, log: MetricsLogger, step: int,
              take_step: Callable[[int], dict], saved_position: Callable[[dict], dict],
              resident: Callable[[], ContextManager[None]] = contextlib.nullcontext
              ) -> list[dict]:
    """Steps ``step`` .. ``--train-iters`` - 1: ``take_step(step)`` gives a step's metrics,
    which are logged; a due save stores ``saved_position(metrics)`` (the data position) with
    the checkpoint, and a due export writes the HF model, both inside ``resident()`` (the
    trainer's state on the device). Returns the steps' metrics."""
    history = []
    freeze_startup_heap()  # model, data and clients stay; full collections skip them
    while step < cfg.train_iters:
        metrics = take_step(step)
        step += 1
        log.log(step, metrics)
        history.append(metrics)
        if save_due(cfg, step):
            with resident():
                engine.save(step, saved_position(metrics))
        if export_due(cfg, step):
            with resident():
                engine.export_hf(str(interval_export_dir(cfg.export_hf, step)),
                                 cfg.hf_checkpoint)
    return history


def finish(cfg: TrainConfig, engine: Engine, log: MetricsLogger) -> None:
    """Close the log; export the trained model to ``--export-hf`` if asked."""
    log.close()
    if cfg.export_hf:
        engine.export_hf(cfg.export_hf, cfg.hf_checkpoint)
