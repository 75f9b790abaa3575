"""Short garbage collections in the long-running processes (trainer ranks, rollout servers,
reward verifiers).

Python's full (generation-2) collection walks every tracked object. After importing torch,
transformers and megatron-core and building a model, that is about a million objects, all
alive until the process exits, so each full collection scans them for nothing: measured on
the embedded rollout server, 0.13-0.36 s per collection, landing inside a decode loop (one
RL step in six took 0.45 s to generate instead of 0.15 s, benchmarks/bench_rl_step.py).
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach
    (``gc.freeze``), so later collections scan only what the process allocates after start-up.
    Call it when start-up is over (imports done, model built), before the work loop."""
    gc.collect()
    gc.freeze()
