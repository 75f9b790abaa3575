"""Group advantages and zero-advantage groups against hand-computed values."""

import math

import pytest
import torch

from megatron_klear.algo.advantages import group_advantages, zero_advantage_groups


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6),
                0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_group_advantages_without_std():
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 6.0])
    adv = group_advantages(rewards, 3, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, -2.0, -2.0, 4.0]))


def test_zero_advantage_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.7, 0.7])
    assert zero_advantage_groups(rewards, 2).tolist() == [True, False, True, True]
    assert zero_advantage_groups(rewards, 4).tolist() == [False, False]


@pytest.mark.parametrize("group_size", [0, 3])
def test_bad_group_size_names_the_flag(group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(8), group_size)


def test_std_needs_two_samples():
    with pytest.raises(ValueError, match="normalize_std"):
        group_advantages(torch.zeros(4), 1)
