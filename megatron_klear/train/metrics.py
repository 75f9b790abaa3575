"""Metrics stream shared by every trainer: JSONL, TensorBoard and a console progress bar.

Only global rank 0 writes. The JSONL file is appended to, so a resumed run continues the
same stream (each record carries its step).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsLogger:
    """Writes ``{"step": n, ...}`` records to ``<log_dir>/metrics.jsonl`` and TensorBoard."""

    def __init__(self, log_dir: str | Path | None, *, total_steps: int, start_step: int = 0,
                 desc: str = "train", progress: bool = True, log_interval: int = 1) -> None:
        self.enabled = _is_rank0()
        self.log_interval = max(1, log_interval)
        self.path = Path(log_dir) / "metrics.jsonl" if log_dir else None
        self._tb = None
        self._bar = None
        if not self.enabled:
            return
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
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
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
        if self._bar is not None:
            self._bar.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
