"""One RL step's data: prompts -> n responses each -> rewards -> group advantages.

The rollout itself is a pipeline of stages over per-sample records (rollout/orchestration/pipeline.py);
this module draws the prompts (:class:`PromptStream`, resumable), runs the rounds that refill
past zero-advantage groups (DAPO-style dynamic sampling) and hands the trainer its
:class:`RolloutBatch`, built from the samples. Only global rank 0 talks to the rollout
servers; the finished batch is broadcast so that every rank builds identical micro-batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from megatron_klear.data.prompts import PromptSample
from megatron_klear.rewards import reward_max_score
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig
from megatron_klear.rollout.orchestration.pipeline import RolloutContext, Sample, build_pipeline

MULTI_TURN_STAGE = "generate=megatron_klear.rollout.orchestration.multi_turn:generate_tool_turns"


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
                   loss_masks=[s.loss_mask for s in samples] if partial else [])

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
            (("loss_masks",) if self.loss_masks else ())

    def select_groups(self, keep: Sequence[int]) -> "RolloutBatch":
        """A batch of the given groups only (stats are kept)."""
        out = RolloutBatch(self.group_size, stats=dict(self.stats), max_score=self.max_score)
        for g in keep:
            for i in range(g * self.group_size, (g + 1) * self.group_size):
                for name in self._fields():
                    getattr(out, name).append(getattr(self, name)[i])
        return out


class PromptStream:
    """Seeded epochs over a prompt dataset; the position (prompts consumed) is resumable."""

    def __init__(self, prompts: Sequence[PromptSample], seed: int, consumed: int = 0):
        self.prompts, self.seed, self.consumed = prompts, seed, consumed
        self._epoch: tuple[int, list[int]] | None = None  # (epoch, its order), drawn once

    def _order(self, epoch: int) -> list[int]:
        """The prompt order of ``epoch``: shuffled once per epoch, not once per prompt (a
        100k-prompt set would otherwise cost a 100k shuffle per prompt drawn)."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def take(self, count: int) -> list[tuple[int, PromptSample]]:
        """The next ``count`` prompts with their stream positions."""
        out = []
        for _ in range(count):
            epoch, pos = divmod(self.consumed, len(self.prompts))
            out.append((self.consumed, self.prompts[self._order(epoch)[pos]]))
            self.consumed += 1
        return out

    def sampling_seed(self, position: int) -> int:
        """The rollout sampling seed of the prompt drawn at ``position`` (resumable)."""
        return (self.seed * 1_000_003 + position) % 2**31


def collect_batch(client: RolloutClient, tokenizer: Any, stream: PromptStream, num_prompts: int,
                  params: SamplingParams, reward: str, *, dynamic_sampling: bool = True,
                  max_rounds: int = 4, normalize_std: bool = True,
                  gen_batch_size: int | None = None, filter_metric: str = "reward",
                  overlong_filter: bool = False,
                  prompt_limit: tuple[int, str] | None = None,
                  remote: RemoteReward | None = None,
                  overlong: OverlongShaping | None = None,
                  stages: Sequence[str] | None = (),
                  multi_turn: MultiTurnConfig | None = None) -> RolloutBatch:
    """A batch of ``num_prompts`` groups through the rollout pipeline (rollout/orchestration/pipeline.py:
    generate -> score -> filters, per round; advantages over the batch), refilled past the
    groups the filters drop when asked.

    With dynamic sampling, rounds of ``gen_batch_size`` (default ``num_prompts``) prompts are
    drawn until enough informative groups exist or ``max_rounds`` is reached (then the batch
    may be smaller; Klear: 256 prompts for 128, one round). A group is uninformative when its
    ``filter_metric`` has no spread among its kept responses: ``reward``, or ``acc`` (reward ==
    the reward's maximum; with format penalties a group can have reward spread and no accuracy
    spread). Of more informative groups than needed, the first ``num_prompts`` are kept.
    ``overlong_filter`` (Klear's): responses without EOS stay without loss tokens and out of
    the group advantages. ``prompt_limit`` = (max tokens, ``left`` | ``error``): see
    :func:`~megatron_klear.rollout.orchestration.pipeline.limit_prompt`. ``remote``: score by the
    ``--reward-url`` service; ``overlong``: DAPO shaping. ``stages``: ``--rollout-stages``
    (:func:`~megatron_klear.rollout.orchestration.pipeline.build_pipeline`). ``multi_turn`` (``--tools``):
    the tools and limits of multi-turn rollouts, generated by
    :func:`~megatron_klear.rollout.orchestration.multi_turn.generate_tool_turns` unless ``stages`` names
    another generate stage.
    """
    n = params.n
    ctx = RolloutContext(client, tokenizer, params, reward, reward_max_score(reward),
                         normalize_std=normalize_std, filter_metric=filter_metric,
                         overlong_filter=overlong_filter, prompt_limit=prompt_limit,
                         remote=remote, overlong=overlong, multi_turn=multi_turn)
    if multi_turn is not None and not any(s.startswith("generate=") for s in stages or ()):
        stages = [MULTI_TURN_STAGE, *(stages or ())]
    pipeline = build_pipeline(stages, overlong_filter=overlong_filter,
                              dynamic_sampling=dynamic_sampling)
    kept: list[Sample] = []      # the batch: whole groups, in the order drawn
    scored: list[Sample] = []    # every response scored this step (the rollout/* stats)
    drawn = dropped = 0
    for _ in range(max_rounds if dynamic_sampling else 1):
        need = num_prompts - len(kept) // n
        drawn_now = stream.take((gen_batch_size or num_prompts) if dynamic_sampling else need)
        got, left = pipeline.round(ctx, [p for _, p in drawn_now],
                                   [stream.sampling_seed(pos) for pos, _ in drawn_now])
        scored += got
        drawn += len(drawn_now)
        dropped += len(drawn_now) - len(left) // n
        kept += left[:need * n]
        if len(kept) // n >= num_prompts:
            break
    pipeline.advantages(ctx, kept)
    return RolloutBatch.from_samples(kept, n, ctx.max_score,
                                     rollout_stats(ctx, scored, drawn, dropped, len(kept) // n))


def rollout_stats(ctx: RolloutContext, scored: Sequence[Sample], drawn: int, dropped: int,
                  groups: int) -> dict[str, float]:
    """A step's rollout metrics: the stages' sums (timings, overlong penalty) and means over
    every response scored in any round; ``dropped`` of the ``drawn`` groups were filtered.
    Multi-turn rollouts' ``multi_turn/*`` sums (calls, tool errors, turn-limit hits, model
    vs tool tokens, rollout/orchestration/multi_turn.py) become means per trajectory."""
    stats = dict(ctx.stats)
    trajectories = stats.pop("multi_turn/samples", 0.0)
    for key in [k for k in stats if k.startswith("multi_turn/")]:
        stats[key] /= max(trajectories, 1.0)
    count = max(len(scored), 1)
    lengths = [len(s.response_ids) for s in scored]
    if "rollout/overlong_penalty" in stats:  # mean over every response scored
        stats["rollout/overlong_penalty"] /= count
    stats.update({
        "rollout/reward_mean": sum(s.reward for s in scored) / count,
        "rollout/accuracy": sum(s.reward >= ctx.max_score for s in scored) / count,
        "rollout/response_len": sum(lengths) / count,
        "rollout/truncation_rate": sum(s.truncated for s in scored) / count,
        "rollout/zero_adv_frac": dropped / max(drawn, 1),
        "rollout/prompts_drawn": float(drawn),
        "rollout/groups_kept": float(groups),
        "rollout/tokens_per_s": sum(lengths) / max(stats.get("time/generate_s", 0.0), 1e-9),
    })
    return stats


def broadcast_batch(batch: RolloutBatch | None) -> RolloutBatch:
    """Share rank 0's batch with every rank."""
    holder = [batch]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]
