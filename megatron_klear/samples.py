"""The rollout's records, at the bottom so that rollout, data and train read one shape:
:class:`Sample` (one response, as the pipeline's stages see it) and :class:`RolloutBatch` (a
step's samples grouped by prompt, as the trainer's micro-batches and loss read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["Sample", "RolloutBatch"]


@dataclass
class Sample:
    """One sampled response to one prompt, as it goes through the stages."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]      # the engine's log-prob of each response token
    loss_mask: list[int]               # per response token: 1 = the model's own, trained
    finish_reason: str                 # the engine's: stop, length, abort, ...
    prompt_index: int                  # the prompt's index in its dataset
    group: int                         # its prompt's position in the generate call
    label: Any = None                  # the reward's reference (answer, tests)
    prompt_text: str = ""
    response_text: str = ""
    routed_experts: torch.Tensor | None = None  # MoE routing replay: flat expert ids
    reward: float = 0.0
    advantage: float = 0.0
    kept: bool = True                  # False: filtered out of the loss and the group stats
    metadata: dict[str, Any] = field(default_factory=dict)  # free for user stages
    # multi-turn rollouts: the turns, tool calls and outputs, why it ended
    # (rollout/orchestration/multi_turn.py Trajectory); None for single-turn samples
    trajectory: Any = None
    # on-policy distillation: the teacher's log-prob of each response token (None: no teacher)
    teacher_logprobs: list[float] | None = None
    # --opd-top-k K: per response token, the teacher's K most likely ids and their log-probs
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None

    @property
    def truncated(self) -> bool:
        """The response hit the token limit instead of ending (no EOS)."""
        return self.finish_reason == "length"


@dataclass
class RolloutBatch:
    """Responses grouped by prompt: sample i belongs to prompt ``i // group_size``."""

    group_size: int
    prompt_ids: list[list[int]] = field(default_factory=list)     # one per sample
    response_ids: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)         # dataset index per sample
    advantages: list[float] = field(default_factory=list)
    # MoE routing replay: per sample, the rollout's expert ids (flat, or None when not asked)
    routed_experts: list = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    max_score: float = 1.0      # the reward's maximum: samples scoring it are the positives
    kept: list[bool] = field(default_factory=list)  # False: dropped by --overlong-filter
    # per sample, per response token: 1 = trained (the model's own), 0 = in the sequence but
    # not trained (multi-turn tool responses); empty when every response token trains
    loss_masks: list[list[int]] = field(default_factory=list)
    # on-policy distillation: per sample, the teacher's log-prob of each response token;
    # empty without a teacher
    teacher_logprobs: list[list[float]] = field(default_factory=list)
    # --opd-top-k K: per sample, per response token, the teacher's K most likely ids and their
    # log-probs; empty without top-k
    teacher_topk_ids: list[list[list[int]]] = field(default_factory=list)
    teacher_topk_logprobs: list[list[list[float]]] = field(default_factory=list)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], group_size: int, max_score: float,
                     stats: dict[str, float]) -> "RolloutBatch":
        """The trainer's batch of the pipeline's samples (whole groups, in order). The
        samples' loss masks are kept only when one masks part of its response."""
        for i, s in enumerate(samples):
            if len(s.loss_mask) != len(s.response_ids) or s.loss_mask.count(0) + \
                    s.loss_mask.count(1) != len(s.loss_mask):
                raise ValueError(f"sample {i}: its loss_mask must hold one 0 or 1 per response "
                                 "token")
        partial = any(s.loss_mask.count(1) != len(s.loss_mask) for s in samples)
        return cls(group_size, prompt_ids=[s.prompt_ids for s in samples],
                   response_ids=[s.response_ids for s in samples],
                   rollout_logprobs=[s.rollout_logprobs for s in samples],
                   rewards=[s.reward for s in samples],
                   truncated=[s.truncated for s in samples],
                   prompt_index=[s.prompt_index for s in samples],
                   advantages=[s.advantage for s in samples],
                   routed_experts=[s.routed_experts for s in samples], stats=stats,
                   max_score=max_score, kept=[s.kept for s in samples],
                   loss_masks=[s.loss_mask for s in samples] if partial else [],
                   teacher_logprobs=[s.teacher_logprobs for s in samples]
                   if samples and samples[0].teacher_logprobs is not None else [],
                   teacher_topk_ids=[s.teacher_topk_ids for s in samples]
                   if samples and samples[0].teacher_topk_ids is not None else [],
                   teacher_topk_logprobs=[s.teacher_topk_logprobs for s in samples]
                   if samples and samples[0].teacher_topk_ids is not None else [])

    def __len__(self) -> int:
        return len(self.response_ids)

    def groups(self) -> int:
        """Number of prompt groups."""
        return len(self) // self.group_size

    def is_kept(self, i: int) -> bool:
        """Sample ``i`` trains (not dropped by the overlong filter)."""
        return not self.kept or self.kept[i]

    def response_mask(self, i: int) -> list[int] | None:
        """Sample ``i``'s per-token loss mask, or None when its whole response trains."""
        return self.loss_masks[i] if self.loss_masks else None

    def _fields(self) -> tuple[str, ...]:
        return ("prompt_ids", "response_ids", "rollout_logprobs", "rewards", "truncated",
                "prompt_index", "advantages") + (("kept",) if self.kept else ()) + \
            (("routed_experts",) if self.routed_experts else ()) + \
            (("loss_masks",) if self.loss_masks else ()) + \
            (("teacher_logprobs",) if self.teacher_logprobs else ()) + \
            (("teacher_topk_ids", "teacher_topk_logprobs") if self.teacher_topk_ids else ())

    def select_groups(self, keep: Sequence[int]) -> "RolloutBatch":
        """A batch of the given groups only (stats are kept)."""
        out = RolloutBatch(self.group_size, stats=dict(self.stats), max_score=self.max_score)
        for g in keep:
            for i in range(g * self.group_size, (g + 1) * self.group_size):
                for name in self._fields():
                    getattr(out, name).append(getattr(self, name)[i])
        return out
