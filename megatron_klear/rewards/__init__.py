"""Reward functions, picked by name from RL configs.

``get_reward("math")``, ``get_reward("code")`` (the test pass rate), ``"code_hard"`` (1 only
when every test passes), ``"math_klear"`` /
``"code_klear"`` (Klear's +-1 with format penalties, rewards/klear.py) or
``get_reward("pkg.module:function")`` returns a ``RewardFn(response, label) -> float``;
``register_reward`` adds a name. A reward's best score is its ``max_score`` attribute (default
1.0): responses reaching it are the positives of the RL SFT term (:func:`reward_max_score`).
``score_batch`` scores many responses with a bounded pool and never raises on garbage
responses. Modules are imported lazily so that importing this package stays cheap.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from megatron_klear.import_path import Registry

RewardFn = Callable[[str, Any], float]
log = logging.getLogger(__name__)

_REWARDS = Registry("reward", {"math": "megatron_klear.rewards.math:math_reward",
                               "code": "megatron_klear.rewards.code:code_reward",
                               "code_hard": "megatron_klear.rewards.code:code_reward_hard",
                               "math_klear": "megatron_klear.rewards.klear:math_klear",
                               "code_klear": "megatron_klear.rewards.klear:code_klear",
                               "none": "megatron_klear.rewards:no_reward"})


def no_reward(response: str, label: Any) -> float:
    """``--reward none``: 0 for every response, so every group advantage is 0 (pure on-policy
    distillation, where the teacher's term is the whole signal; train/opd_flags.py)."""
    return 0.0


def register_reward(name: str, fn: RewardFn) -> None:
    """Make ``fn`` available as ``get_reward(name)`` (replaces an earlier registration)."""
    _REWARDS.register(name, fn)


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``, a built-in ('math', 'code') or 'pkg.module:function'."""
    return _REWARDS.get(name)


def check_reward(name: str, flag: str = "--reward") -> None:
    """Raise :class:`~megatron_klear.config.ConfigError` naming ``flag`` when ``name`` is no
    registered reward and no import path that resolves (the pre-flight check of a run)."""
    from megatron_klear.config import ConfigError

    try:
        get_reward(name)
    except ValueError as exc:
        raise ConfigError(f"{flag} {name}: {exc}") from None


def reward_max_score(name: str) -> float:
    """The best score of the reward ``name``: its function's ``max_score`` attribute, else 1."""
    return float(getattr(get_reward(name), "max_score", 1.0))


def _safe(fn: RewardFn, response: str, label: Any) -> float:
    try:
        return float(fn(response, label))
    except Exception:  # noqa: BLE001 - a crashing reward must not stop training
        log.exception("reward raised on a response; scoring it 0.0")
        return 0.0


def score_batch(name: str, responses: list[str], labels: list[Any], *,
                num_workers: int | None = None, progress: str | None = None) -> list[float]:
    """Scores of ``responses`` against ``labels`` in order, in parallel with at most
    ``num_workers`` concurrent evaluations (default: one per core). Code runs through the
    sandbox pool and math through the timed verifier processes, both bounded the same way;
    a reward function with a ``score_many(responses, labels, workers, done)`` attribute (the
    math reward's) scores the whole batch itself.
    ``progress``: show a tqdm bar with this description."""
    if len(responses) != len(labels):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(labels)} labels")
    fn = get_reward(name)
    from megatron_klear.rewards.sandbox import default_workers

    workers = num_workers or default_workers()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(responses), desc=progress, unit="response")
    try:
        many = getattr(fn, "score_many", None)  # a reward that batches its own work
        if many is not None:
            return [float(s) for s in many(list(responses), list(labels), workers,
                                           bar.update if bar else None)]
        with ThreadPoolExecutor(workers, thread_name_prefix=f"reward-{name}") as ex:
            scores = []
            for score in ex.map(lambda rl: _safe(fn, *rl), zip(responses, labels)):
                scores.append(score)
                if bar:
                    bar.update(1)
            return scores
    finally:
        if bar:
            bar.close()
