"""Metrics stream shared by every trainer: JSONL, TensorBoard, optional W&B and a console
progress bar.

Only global rank 0 writes. The JSONL file is appended to, so a resumed run continues the
same stream (each record carries its step); a resumed run continues its W&B run too (the run
id is kept beside metrics.jsonl).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record: what TensorBoard and W&B plot."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(v)}


@dataclass
class WandbSettings:
    """Where a run's W&B copy goes (``--wandb-*`` flags)."""

    project: str
    run_name: str | None = None
    mode: str = "online"
    dir: str | None = None
    config: dict | None = None


def _start_wandb(settings: WandbSettings, log_dir: Path | None) -> Any:
    """A W&B run; resumed under the id kept in ``log_dir`` so a resumed run continues it."""
    import wandb

    root = Path(settings.dir or log_dir or ".")
    root.mkdir(parents=True, exist_ok=True)
    id_file = (log_dir or root) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return wandb.init(project=settings.project, name=settings.run_name, mode=settings.mode,
                      dir=str(root), id=run_id, resume="allow", config=settings.config)


class MetricsLogger:
    """Writes ``{"step": n, ...}`` records to ``<log_dir>/metrics.jsonl``, TensorBoard and,
    with ``wandb``, a W&B run (the same scalars as TensorBoard)."""

    def __init__(self, log_dir: str | Path | None, *, total_steps: int, start_step: int = 0,
                 desc: str = "train", progress: bool = True, log_interval: int = 1,
                 wandb: WandbSettings | None = None) -> None:
        self.enabled = _is_rank0()
        self.log_interval = max(1, log_interval)
        self.path = Path(log_dir) / "metrics.jsonl" if log_dir else None
        self._tb = None
        self._bar = None
        self._wandb = None
        if not self.enabled:
            return
        if wandb is not None:
            self._wandb = _start_wandb(wandb, self.path.parent if self.path else None)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except Exception:  # tensorboard is optional at run time
                self._tb = None
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, dynamic_ncols=True)
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the metrics of ``step`` (1-based optimizer step)."""
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time() - self._t0, 3), **metrics}
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=float) + "\n")
        scalars = _scalars(metrics)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None:
            self._bar.update(1)
            shown = {k: v for k, v in metrics.items() if isinstance(v, float)}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in list(shown.items())[:4]})
        elif step % self.log_interval == 0:
            print(json.dumps(record, default=float), flush=True)

    def close(self) -> None:
        """Flush and close the outputs."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def wandb_settings(cfg: Any) -> WandbSettings | None:
    """The W&B settings of a trainer config (None without ``--wandb-project``)."""
    if not cfg.wandb_project:
        return None
    from megatron_klear.config import to_dict

    return WandbSettings(cfg.wandb_project, cfg.wandb_run_name, cfg.wandb_mode, cfg.wandb_dir,
                         config=to_dict(cfg))
