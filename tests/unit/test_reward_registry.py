"""Reward registry, score_batch and pass@k."""

import itertools
import math

import pytest

from megatron_klear.rewards import get_reward, register_reward, score_batch
from megatron_klear.rewards.code import code_reward
from megatron_klear.rewards.math import math_reward
from megatron_klear.rewards.metrics import pass_at_k


def test_builtin_names_and_import_paths():
    assert get_reward("math") is math_reward
    assert get_reward("code") is code_reward
    fn = get_reward("tests.reward_plugins:length_reward")
    assert fn("abc", 3) == 1.0 and fn("abc", 4) == 0.0


def test_register_and_unknown_names():
    register_reward("always_half", lambda response, label: 0.5)
    assert get_reward("always_half")("x", None) == 0.5
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot load reward"):
        get_reward("tests.reward_plugins:missing")
    with pytest.raises(TypeError):
        register_reward("bad", 3)


def test_score_batch_keeps_order_and_never_raises():
    responses = [f"\\boxed{{{i}}}" for i in range(6)] + [None, "\\boxed{"]
    labels = [str(i if i % 2 else i + 1) for i in range(6)] + ["1", "1"]
    assert score_batch("math", responses, labels, num_workers=2) == \
        [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert score_batch("tests.reward_plugins:crashing_reward", ["a", "b"], [1, 2]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 responses but 1 labels"):
        score_batch("math", ["a", "b"], ["1"])


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (8, 3, 4), (6, 6, 2), (10, 1, 10),
                                   (7, 2, 5)])
def test_pass_at_k_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_bad_arguments():
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)
    assert math.isclose(pass_at_k(200, 0, 16), 0.0)
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
