"""Test-case filtering: drop code problems whose tests no sampled (or reference) solution
passes. When pass@k of k responses is 0, the tests are most likely flawed (Klear-Reasoner
filters with pass@16), and such a problem only adds zero-advantage groups to RL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_klear.rewards import score_batch
from megatron_klear.rewards.metrics import pass_at_k


@dataclass
class ProblemVerdict:
    """Per-problem outcome: responses scored, fully-correct count, pass@k, kept or not."""

    index: int
    n: int
    correct: int
    pass_at_k: float
    kept: bool


def fence_python(code: str) -> str:
    """Wrap a bare reference solution as a response (a fenced python block)."""
    return code if "```" in code else f"```python\n{code}\n```"


def judge_problems(responses: list[list[str]], labels: list[Any], *, k: int | None = None,
                   reward: str = "code", num_workers: int | None = None) -> list[ProblemVerdict]:
    """Score every response of every problem (one flat, bounded batch) and keep a problem
    iff pass@k > 0, i.e. at least one response passes all its tests (reward 1.0)."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} response lists for {len(labels)} problems")
    flat = [(i, r) for i, rs in enumerate(responses) for r in rs]
    scores = score_batch(reward, [r for _, r in flat], [labels[i] for i, _ in flat],
                         num_workers=num_workers, progress="score responses")
    correct = [0] * len(labels)
    for (i, _), s in zip(flat, scores):
        correct[i] += s == 1.0
    verdicts = []
    for i, rs in enumerate(responses):
        n = len(rs)
        p = pass_at_k(n, correct[i], min(k or n, n)) if n else 0.0
        verdicts.append(ProblemVerdict(i, n, correct[i], p, p > 0.0))
    return verdicts
