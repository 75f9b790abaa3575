"""Reward shaping applied after scoring: DAPO's soft overlong punishment.

A response of length L with at most ``L_max`` new tokens and a buffer ``L_buf`` gets
``min(0, -(L - (L_max - L_buf)) / L_buf * factor)`` added to its reward: nothing up to
``L_max - L_buf`` tokens, then linearly down to ``-factor`` at ``L_max`` (DAPO, arXiv
2503.14476, eq. 13; verl's ``overlong_buffer_cfg``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlongShaping"]


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's overlong penalty for responses of at most ``max_len`` tokens."""

    max_len: int
    buffer_len: int
    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer_len <= self.max_len:
            raise ValueError(f"--overlong-buffer-len must be in [1, --rollout-max-response-len "
                             f"{self.max_len}], got {self.buffer_len}")
        if self.factor < 0:
            raise ValueError(f"--overlong-penalty-factor must be >= 0, got {self.factor}")

    def penalty(self, length: int) -> float:
        """The (non-positive) reward added to a response of ``length`` tokens."""
        exceed = length - (self.max_len - self.buffer_len)
        return min(0.0, -exceed / self.buffer_len * self.factor)
