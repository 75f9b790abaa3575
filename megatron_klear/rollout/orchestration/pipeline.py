"""A rollout round as a pipeline of stages over per-sample records.

    generate -> score -> filters -> (the trainer's batch accounting) -> advantages

:class:`Sample` is one response with everything the stages and the trainer need: its token
ids, the rollout log-probs, a per-token loss mask, the finish reason, reward, advantage,
routed experts and metadata. Every stage is a small function, so a user replaces one by name
or import path (``--rollout-stages filter=pkg.mod:fn``), as rewards are replaced:

- generate ``(ctx, prompts, seeds) -> list[Sample]``: ``n`` samples per prompt, in prompt
  order (built-in ``generate``: one turn through the rollout servers);
- score ``(ctx, samples) -> samples``: sets ``reward`` (built-in ``score``: ``--reward`` here
  or the ``--reward-url`` service, then DAPO overlong shaping);
- filter ``(ctx, samples) -> samples``: may set ``kept`` False (the sample stays, trains no
  token and is left out of its group's statistics) or drop whole groups (built-ins
  ``overlong_filter``, ``group_filter``; a group that loses some but not all of its samples
  is refused);
- advantages ``(ctx, samples) -> samples``: sets ``advantage`` (built-in ``grpo``).

Stages read their settings from the :class:`RolloutContext` and add timings to its
``stats``. The rounds and prompt accounting live in train/rl_data.py (``collect_batch``);
:class:`Sample` and the trainer's :class:`~megatron_klear.samples.RolloutBatch` live at the
bottom (megatron_klear/samples.py); this module knows nothing of the trainer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megatron_klear.algo.advantages import flat_groups, group_advantages, \
    kept_group_advantages
from megatron_klear.data.prompts import PromptSample, render_prompt
from megatron_klear.import_path import Registry
from megatron_klear.rewards import score_batch
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.samples import Sample

__all__ = ["RolloutContext", "RolloutPipeline", "build_pipeline", "register_stage",
           "get_stage", "generate_responses", "score_samples", "drop_truncated",
           "drop_flat_groups", "grpo_advantages", "limit_prompt", "STAGE_KINDS"]


@dataclass
class RolloutContext:
    """What the stages of one batch share: the servers, tokenizer and sampling, the reward
    and filter settings, and ``stats`` (sums over the batch's rounds) the stages add to."""

    client: RolloutClient
    tokenizer: Any
    params: SamplingParams
    reward: str                        # reward name or import path (--reward)
    max_score: float                   # the reward's maximum: samples reaching it are correct
    normalize_std: bool = True
    filter_metric: str = "reward"      # group_filter: spread of reward, or acc
    overlong_filter: bool = False
    prompt_limit: tuple[int, str] | None = None  # (max tokens, left | error | off)
    remote: RemoteReward | None = None
    overlong: OverlongShaping | None = None
    multi_turn: Any = None             # rollout/orchestration/multi_turn.py MultiTurnConfig (tools, limits)
    stats: dict[str, float] = field(default_factory=dict)

    def add_stat(self, key: str, value: float) -> None:
        """Add ``value`` to the batch's sum ``key``."""
        self.stats[key] = self.stats.get(key, 0.0) + value


Generate = Callable[[RolloutContext, Sequence[PromptSample], Sequence[int]], list[Sample]]
Stage = Callable[[RolloutContext, list[Sample]], list[Sample]]


# ------------------------------------------------------------------------------ stages
def limit_prompt(ids: list[int], sample: PromptSample, limit: tuple[int, str] | None
                 ) -> list[int]:
    """A rendered prompt's token ids under ``limit`` = (max tokens, mode): ``left`` keeps the
    last max tokens (verl's ``truncation='left'``, as Klear's scripts run it), ``error``
    refuses a longer prompt; None or mode ``off``: unchanged."""
    if limit is None or limit[1] == "off" or len(ids) <= limit[0]:
        return ids
    if limit[1] == "left":
        return ids[-limit[0]:]
    raise ValueError(f"prompt {sample.index} has {len(ids)} tokens, more than "
                     f"--rollout-max-prompt-len {limit[0]}: raise it, filter the data, or pass "
                     "--truncate-prompt left")


def generate_responses(ctx: RolloutContext, prompts: Sequence[PromptSample],
                       seeds: Sequence[int]) -> list[Sample]:
    """``params.n`` single-turn responses per prompt (rendered with the chat template, limited
    by ``prompt_limit``), sampled by the rollout servers with the per-prompt ``seeds``."""
    rendered = [render_prompt(ctx.tokenizer, p.messages) for p in prompts]
    prompt_ids = [limit_prompt(ctx.tokenizer(text, add_special_tokens=False)["input_ids"], p,
                               ctx.prompt_limit) for text, p in zip(rendered, prompts)]
    t0 = time.time()
    gens = ctx.client.generate(prompt_ids, ctx.params, list(seeds))
    ctx.add_stat("time/generate_s", time.time() - t0)
    return [Sample(prompt_ids=ids, response_ids=list(g.output_ids),
                   rollout_logprobs=list(g.logprobs), loss_mask=[1] * len(g.output_ids),
                   finish_reason=g.finish_reason, prompt_index=p.index, group=i,
                   label=p.label, prompt_text=text, response_text=g.text,
                   routed_experts=g.routed_experts)
            for i, (p, text, ids, group) in enumerate(zip(prompts, rendered, prompt_ids, gens))
            for g in group]


def score_samples(ctx: RolloutContext, samples: list[Sample]) -> list[Sample]:
    """Rewards by ``ctx.reward`` here, or by the ``ctx.remote`` service; then DAPO's overlong
    penalty (``ctx.overlong``) added to them."""
    texts = [s.response_text for s in samples]
    labels = [s.label for s in samples]
    t0 = time.time()
    scores = ctx.remote.score([s.prompt_text for s in samples], texts, labels) if ctx.remote \
        else score_batch(ctx.reward, texts, labels)
    ctx.add_stat("time/reward_s", time.time() - t0)
    for s, r in zip(samples, scores):
        s.reward = float(r)
    if ctx.overlong is not None:
        penalties = [ctx.overlong.penalty(len(s.response_ids)) for s in samples]
        for s, p in zip(samples, penalties):
            s.reward += p
        ctx.add_stat("rollout/overlong_penalty", sum(penalties))  # summed over rounds
    return samples


def drop_truncated(ctx: RolloutContext, samples: list[Sample]) -> list[Sample]:
    """Klear's ``overlong_filter``: responses that did not end in EOS (finish reason
    ``length``) stay in their group without loss tokens and out of its advantages."""
    for s in samples:
        if s.truncated:
            s.kept = False
    return samples


def group_filter_values(samples: Sequence[Sample], metric: str, max_score: float
                        ) -> torch.Tensor:
    """Per-response values whose spread makes a group informative: rewards or accuracies."""
    if metric == "reward":
        return torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if metric == "acc":
        return torch.tensor([float(s.reward >= max_score) for s in samples])
    raise ValueError(f"unknown group filter metric {metric!r}: use reward or acc")


def drop_flat_groups(ctx: RolloutContext, samples: list[Sample]) -> list[Sample]:
    """Dynamic sampling: drop the groups whose kept responses have no spread in
    ``ctx.filter_metric`` (zero advantage: no policy gradient), or keep fewer than 2."""
    n = ctx.params.n
    values = group_filter_values(samples, ctx.filter_metric, ctx.max_score)
    flat = flat_groups(values, torch.tensor([s.kept for s in samples]), n).tolist()
    return [s for i, s in enumerate(samples) if not flat[i // n]]


def grpo_advantages(ctx: RolloutContext, samples: list[Sample]) -> list[Sample]:
    """GRPO advantages (algo/advantages.py) over each group of ``params.n`` consecutive
    samples; over the kept samples only when a filter dropped some (or with the overlong
    filter on)."""
    if not samples:
        return samples
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    kept = [s.kept for s in samples]
    if ctx.overlong_filter or not all(kept):
        adv = kept_group_advantages(rewards, torch.tensor(kept), ctx.params.n,
                                    normalize_std=ctx.normalize_std)
    else:
        adv = group_advantages(rewards, ctx.params.n, normalize_std=ctx.normalize_std)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return samples


# ------------------------------------------------------------------- registry, pipeline
STAGE_KINDS = ("generate", "score", "filter", "advantages")
_STAGES = Registry("rollout stage", {"generate": generate_responses, "score": score_samples,
                                     "overlong_filter": drop_truncated,
                                     "group_filter": drop_flat_groups, "grpo": grpo_advantages})


def register_stage(name: str, fn: Callable) -> None:
    """Make ``fn`` available as the stage ``name`` (replaces an earlier registration)."""
    _STAGES.register(name, fn)


def get_stage(name: str) -> Callable:
    """The stage registered as ``name`` (built-ins: generate, score, overlong_filter,
    group_filter, grpo) or at the import path 'pkg.module:function'."""
    return _STAGES.get(name)


@dataclass(frozen=True)
class RolloutPipeline:
    """The stages of a rollout, in order."""

    generate: Generate = generate_responses
    score: Stage = score_samples
    filters: tuple[Stage, ...] = ()
    advantages: Stage = grpo_advantages

    def round(self, ctx: RolloutContext, prompts: Sequence[PromptSample],
              seeds: Sequence[int]) -> tuple[list[Sample], list[Sample]]:
        """One generation round: (every sample scored, the samples the filters left). Both
        hold whole groups of ``params.n`` consecutive samples, in prompt order."""
        samples = self.generate(ctx, prompts, seeds)
        _check_groups(samples, ctx.params.n, self.generate, expected=len(prompts))
        scored = self.score(ctx, samples)
        _check_groups(scored, ctx.params.n, self.score, expected=len(prompts))
        left = scored
        for stage in self.filters:
            left = stage(ctx, list(left))
            _check_groups(left, ctx.params.n, stage)
        return scored, left


def _check_groups(samples: list[Sample], n: int, stage: Callable,
                  expected: int | None = None) -> None:
    """Refuse what a (user) stage returned unless it is whole groups of ``n`` samples."""
    blocks = [samples[i:i + n] for i in range(0, len(samples), n)]
    if (len(samples) % n or any(len({s.group for s in b}) != 1 for b in blocks)
            or (expected is not None and len(blocks) != expected)):
        name = getattr(stage, "__qualname__", repr(stage))
        want = f"{expected} groups" if expected is not None else "whole groups"
        raise ValueError(f"rollout stage {name} returned {len(samples)} samples that are not "
                         f"{want} of --n-samples-per-prompt {n} consecutive samples of one "
                         "prompt; a filter drops whole groups, or marks samples kept=False")


def build_pipeline(specs: Sequence[str] | None = (), *, overlong_filter: bool = False,
                   dynamic_sampling: bool = True) -> RolloutPipeline:
    """The pipeline of the flags: built-in stages, the overlong filter (``overlong_filter``),
    the ``--rollout-stages`` filters in order, then the zero-advantage group filter
    (``dynamic_sampling``). A spec ``KIND=STAGE`` (kinds :data:`STAGE_KINDS`) replaces the
    generate, score or advantages stage, or adds a filter; STAGE is a registered name or an
    import path. ValueError names a bad spec."""
    chosen: dict[str, Callable] = {}
    user_filters: list[Callable] = []
    for spec in specs or ():
        kind, sep, name = spec.partition("=")
        if not sep or kind not in STAGE_KINDS or not name:
            raise ValueError(f"--rollout-stages {spec!r}: expected KIND=STAGE with KIND one of "
                             f"{', '.join(STAGE_KINDS)} (e.g. filter=pkg.mod:fn)")
        if kind != "filter" and kind in chosen:
            raise ValueError(f"--rollout-stages {spec!r}: the {kind} stage is given twice")
        fn = get_stage(name)
        if kind == "filter":
            user_filters.append(fn)
        else:
            chosen[kind] = fn
    filters = ([drop_truncated] if overlong_filter else []) + user_filters + \
        ([drop_flat_groups] if dynamic_sampling else [])
    return RolloutPipeline(filters=tuple(filters), **chosen)
