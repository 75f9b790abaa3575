"""A PNG dashboard of a metrics.jsonl stream (one panel per metric)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from megatron_klear.train.metrics import read_metrics

DEFAULT_KEYS = ("rollout/reward_mean", "rollout/accuracy", "rollout/response_len",
                "rollout/zero_adv_frac", "train/policy_loss", "train/sft_loss",
                "train/clipfrac_low", "train/clipfrac_high", "train/entropy", "grad_norm",
                "weight_sync/gbps", "weight_sync/probe_max_abs_diff", "loss", "lr")


def plot_metrics(metrics_path: str | Path, out_png: str | Path,
                 keys: Sequence[str] | None = None) -> Path:
    """Plot every numeric metric in ``keys`` (default: the RL/SFT essentials present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path}: no metrics records to plot")
    wanted = keys or DEFAULT_KEYS
    present = [k for k in wanted if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not present:
        raise ValueError(f"{metrics_path}: none of the metrics {list(wanted)} is present")
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
