"""One RL step's data: prompts -> n responses each -> rewards -> group advantages.

The rollout itself is a pipeline of stages over per-sample records (rollout/orchestration/pipeline.py);
this module draws the prompts (:class:`PromptStream`, resumable), runs the rounds that refill
past zero-advantage groups (DAPO-style dynamic sampling) and hands the trainer its
:class:`RolloutBatch`, built from the samples. Only global rank 0 talks to the rollout
servers; the finished batch is broadcast so that every rank builds identical micro-batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from megatron_klear.config import ConfigError, Section, opt
from megatron_klear.data.prompts import PromptSample
from megatron_klear.rewards import reward_max_score
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig
from megatron_klear.rollout.orchestration.pipeline import RolloutContext, build_pipeline
from megatron_klear.rollout.orchestration.teacher import TeacherClient
from megatron_klear.samples import RolloutBatch, Sample
from megatron_klear.train.learning_signal import WARN_EVERY

MULTI_TURN_STAGE = "generate=megatron_klear.rollout.orchestration.multi_turn:generate_tool_turns"


@dataclass
class DynamicSamplingFlags(Section):
    """Dropping uninformative groups, refilling and over-generating (Klear's recipe)."""

    title = "dynamic sampling"
    advantage_std_norm: bool = opt(True, "divide group advantages by the group std")
    dynamic_sampling: bool = opt(True, "drop zero-advantage groups and refill the batch")
    max_sampling_rounds: int = opt(4, "rollout rounds allowed to refill a batch")
    rollout_gen_batch_size: int | None = opt(None, "over-generation: prompts generated per "
                                             "round (Klear: 256 for --rollout-batch-size 128);"
                                             " the step trains on the informative groups left,"
                                             " at most --rollout-batch-size, the last "
                                             "mini-batch possibly partial; unset or 0 (to "
                                             "turn a YAML's off): refill to whole mini-batches")
    max_gen_rounds: int | None = opt(None, "generation rounds per step (1: no refill, Klear's "
                                     "max_num_gen_batches=1); default --max-sampling-rounds")
    filter_groups_metric: str = opt("reward", "dynamic sampling drops the groups without "
                                    "spread in this: reward, or acc (reward == the reward's "
                                    "maximum: Klear's filter_groups_metric=acc)",
                                    choices=("reward", "acc"))
    overlong_filter: bool = opt(False, "drop the responses that did not end in EOS before the "
                                "group filter (no loss tokens, not in the group advantages)")
    max_skipped_steps: int = opt(30, "stop the run (exit 1) after this many steps in a row "
                                 "skipped for want of groups with a reward spread (all 0 or "
                                 f"all 1); a warning every {WARN_EVERY} such steps says which "
                                 "and what helps")

    def validate_section(self) -> None:
        """Over-generation flags (Klear's recipe, docs/recipe.md); 0 is "off"."""
        gen = self.rollout_gen_batch_size
        if gen and (gen < self.rollout_batch_size or not self.dynamic_sampling):
            raise ConfigError(f"--rollout-gen-batch-size {gen} over-generates for dynamic "
                              f"sampling: it needs --dynamic-sampling and >= "
                              f"--rollout-batch-size {self.rollout_batch_size}")
        if gen is not None and gen < 0:
            raise ConfigError(f"--rollout-gen-batch-size must be >= 0 (0: off), got {gen}")
        if self.max_sampling_rounds < 1:
            raise ConfigError(f"--max-sampling-rounds must be >= 1, got "
                              f"{self.max_sampling_rounds}")
        if self.max_skipped_steps < 1:
            raise ConfigError(f"--max-skipped-steps must be >= 1, got {self.max_skipped_steps}")
        if self.max_gen_rounds is not None and self.max_gen_rounds < 1:
            raise ConfigError(f"--max-gen-rounds must be >= 1 (1: no refill), got "
                              f"{self.max_gen_rounds}")


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
                  params: SamplingParams, reward: str,
                  sampling: DynamicSamplingFlags = DynamicSamplingFlags(), *,
                  prompt_limit: tuple[int, str] | None = None,
                  remote: RemoteReward | None = None,
                  overlong: OverlongShaping | None = None,
                  stages: Sequence[str] | None = (),
                  multi_turn: MultiTurnConfig | None = None,
                  teacher: TeacherClient | None = None, opd: bool = False) -> RolloutBatch:
    """A batch of ``num_prompts`` groups through the rollout pipeline (rollout/orchestration/pipeline.py:
    generate -> score -> filters, per round; advantages over the batch), refilled past the
    groups the filters drop when asked.

    ``sampling``: the dynamic-sampling section. With dynamic sampling, rounds of
    ``rollout_gen_batch_size`` (default ``num_prompts``) prompts are drawn until enough
    informative groups exist or ``max_gen_rounds`` (default ``max_sampling_rounds``) is
    reached (then the batch may be smaller; Klear: 256 prompts for 128, one round). A group is
    uninformative when its ``filter_groups_metric`` has no spread among its kept responses:
    ``reward``, or ``acc`` (reward == the reward's maximum; with format penalties a group can
    have reward spread and no accuracy spread). Of more informative groups than needed, the
    first ``num_prompts`` are kept. ``overlong_filter`` (Klear's): responses without EOS stay
    without loss tokens and out of the group advantages. ``prompt_limit`` = (max tokens, ``left`` | ``error``): see
    :func:`~megatron_klear.rollout.orchestration.pipeline.limit_prompt`. ``remote``: score by the
    ``--reward-url`` service; ``overlong``: DAPO shaping. ``stages``: ``--rollout-stages``
    (:func:`~megatron_klear.rollout.orchestration.pipeline.build_pipeline`). ``multi_turn`` (``--tools``):
    the tools and limits of multi-turn rollouts, generated by
    :func:`~megatron_klear.rollout.orchestration.multi_turn.generate_tool_turns` unless ``stages`` names
    another generate stage. ``teacher``: the served teacher (``--use-opd --opd-type sglang``)
    that scores the batch's response tokens (on-policy distillation; a Megatron teacher
    scores in the trainer). ``opd`` (``--use-opd``): no group is dropped for a flat reward,
    since every group carries the teacher's signal.
    """
    n, dynamic = params.n, sampling.dynamic_sampling and not (opd or teacher)
    ctx = RolloutContext(client, tokenizer, params, reward, reward_max_score(reward),
                         normalize_std=sampling.advantage_std_norm,
                         filter_metric=sampling.filter_groups_metric,
                         overlong_filter=sampling.overlong_filter, prompt_limit=prompt_limit,
                         remote=remote, overlong=overlong, multi_turn=multi_turn)
    if multi_turn is not None and not any(s.startswith("generate=") for s in stages or ()):
        stages = [MULTI_TURN_STAGE, *(stages or ())]
    pipeline = build_pipeline(stages, overlong_filter=sampling.overlong_filter,
                              dynamic_sampling=dynamic)
    kept: list[Sample] = []      # the batch: whole groups, in the order drawn
    scored: list[Sample] = []    # every response scored this step (the rollout/* stats)
    drawn = dropped = 0
    for _ in range((sampling.max_gen_rounds or sampling.max_sampling_rounds) if dynamic else 1):
        need = num_prompts - len(kept) // n
        drawn_now = stream.take((sampling.rollout_gen_batch_size or num_prompts) if dynamic
                                else need)
        got, left = pipeline.round(ctx, [p for _, p in drawn_now],
                                   [stream.sampling_seed(pos) for pos, _ in drawn_now])
        scored += got
        drawn += len(drawn_now)
        dropped += len(drawn_now) - len(left) // n
        kept += left[:need * n]
        if len(kept) // n >= num_prompts:
            break
    pipeline.advantages(ctx, kept)
    if teacher is not None:
        for key, seconds in teacher.score(kept).items():
            ctx.add_stat(key, seconds)
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
