"""Group-relative advantages (GRPO) and zero-advantage group detection.

Rewards arrive as a flat ``[N]`` tensor holding ``N // group_size`` consecutive groups, each the
``group_size`` sampled responses of one prompt. The advantage of a response is its reward minus
the group mean, divided by the group's standard deviation when ``normalize_std`` is set.

Which std: the **unbiased** sample standard deviation (Bessel's correction, ``unbiased=True``,
divide by ``group_size - 1``), as in GRPO implementations built on ``torch.std`` (e.g. verl).
Groups whose rewards are all equal get advantage 0 for every response: they carry no learning
signal and the RL loop drops them (:func:`zero_advantage_groups`) and refills by oversampling.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages", "zero_advantage_groups", "kept_group_advantages", "flat_groups"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View ``rewards [N]`` as ``[N // group_size, group_size]``, validating the shapes."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of rewards "
                         f"({rewards.numel()}); check --n-samples-per-prompt")
    return rewards.view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO advantages [N]: ``(r - group mean) / (group std + eps)`` (std optional, unbiased)."""
    groups = _grouped(rewards, group_size).to(torch.float32)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        if group_size < 2:
            raise ValueError("normalize_std needs group_size >= 2 (the unbiased std of one sample "
                             "is undefined); pass normalize_std=False or sample more per prompt")
        centered = centered / (groups.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centered.reshape(-1)


def zero_advantage_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool [N // group_size]: True for groups whose rewards are all equal (zero advantage)."""
    groups = _grouped(rewards, group_size)
    return groups.amax(dim=1) == groups.amin(dim=1)


def kept_group_advantages(rewards: Tensor, keep: Tensor, group_size: int, *,
                          normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages [N] over the kept responses of each group only (``keep`` [N] bool, e.g.
    the overlong filter's finished responses): mean and unbiased std of the kept rewards;
    dropped responses, and groups with fewer than 2 kept, get 0."""
    groups = _grouped(rewards, group_size).to(torch.float32)
    kept = _grouped(keep.to(torch.bool), group_size)
    count = kept.sum(dim=1, keepdim=True)
    mean = torch.where(kept, groups, 0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(kept, groups - mean, 0)
    if normalize_std:
        var = (centered ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centered = centered / (var.sqrt() + eps)
    return torch.where(count >= 2, centered, 0).reshape(-1)


def flat_groups(values: Tensor, keep: Tensor, group_size: int) -> Tensor:
    """Bool [N // group_size]: groups whose kept ``values`` (rewards, or accuracies for
    Klear's ``filter_groups_metric=acc``) have no spread, or that keep fewer than 2."""
    groups = _grouped(values.to(torch.float64), group_size)
    kept = _grouped(keep.to(torch.bool), group_size)
    hi = torch.where(kept, groups, -torch.inf).amax(dim=1)
    lo = torch.where(kept, groups, torch.inf).amin(dim=1)
    return (kept.sum(dim=1) < 2) | (hi == lo)
