"""One RL step's data: prompts -> n responses each -> rewards -> group advantages.

Zero-advantage groups (all n responses scored the same) carry no policy gradient; they
are dropped and the batch is refilled by sampling more prompts (DAPO-style dynamic
sampling). Only global rank 0 talks to the rollout servers; the finished batch is
broadcast so that every rank builds identical micro-batches.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_klear.algo.advantages import flat_groups, group_advantages, \
    kept_group_advantages
from megatron_klear.data.prompts import PromptSample, render_prompt
from megatron_klear.rewards import reward_max_score, score_batch
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.rollout.client import RolloutClient, SamplingParams


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

    def __len__(self) -> int:
        return len(self.response_ids)

    def groups(self) -> int:
        """Number of prompt groups."""
        return len(self) // self.group_size

    def is_kept(self, i: int) -> bool:
        """Sample ``i`` trains (not dropped by the overlong filter)."""
        return not self.kept or self.kept[i]

    def _fields(self) -> tuple[str, ...]:
        return ("prompt_ids", "response_ids", "rollout_logprobs", "rewards", "truncated",
                "prompt_index", "advantages") + (("kept",) if self.kept else ()) + \
            (("routed_experts",) if self.routed_experts else ())

    def select_groups(self, keep: Sequence[int]) -> "RolloutBatch":
        """A batch of the given groups only (stats are kept)."""
        out = RolloutBatch(self.group_size, stats=dict(self.stats), max_score=self.max_score)
        for g in keep:
            for i in range(g * self.group_size, (g + 1) * self.group_size):
                for name in self._fields():
                    getattr(out, name).append(getattr(self, name)[i])
        return out

    def extend(self, other: "RolloutBatch") -> None:
        """Append another batch's samples."""
        for name in other._fields():
            getattr(self, name).extend(getattr(other, name))


class PromptStream:
    """Seeded epochs over a prompt dataset; the position (prompts consumed) is resumable."""

    def __init__(self, prompts: Sequence[PromptSample], seed: int, consumed: int = 0):
        self.prompts, self.seed, self.consumed = prompts, seed, consumed

    def take(self, count: int) -> list[tuple[int, PromptSample]]:
        """The next ``count`` prompts with their stream positions."""
        out = []
        for _ in range(count):
            epoch, pos = divmod(self.consumed, len(self.prompts))
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            out.append((self.consumed, self.prompts[order[pos]]))
            self.consumed += 1
        return out

    def sampling_seed(self, position: int) -> int:
        """The rollout sampling seed of the prompt drawn at ``position`` (resumable)."""
        return (self.seed * 1_000_003 + position) % 2**31


def generate_and_score(client: RolloutClient, tokenizer: Any, prompts: Sequence[PromptSample],
                       params: SamplingParams, reward: str, *, normalize_std: bool = True,
                       reward_workers: int | None = None, seeds: list[int] | None = None,
                       overlong_filter: bool = False,
                       prompt_limit: tuple[int, str] | None = None,
                       remote: RemoteReward | None = None,
                       overlong: OverlongShaping | None = None) -> RolloutBatch:
    """Sample ``params.n`` responses per prompt, score them (here with the ``reward``
    function, or by the ``remote`` service), shape the rewards (``overlong``) and compute
    group advantages.

    ``overlong_filter`` (Klear's ``overlong_filter``) drops the responses that did not end in
    EOS (finish reason ``length``): they stay in the batch without loss tokens
    (``kept`` False) and the group advantages use the kept responses only. ``prompt_limit``
    = (max tokens, ``left`` | ``error``): see :func:`limit_prompt`."""
    rendered = [render_prompt(tokenizer, p.messages) for p in prompts]
    prompt_ids = [limit_prompt(tokenizer(text, add_special_tokens=False)["input_ids"], p,
                               prompt_limit) for text, p in zip(rendered, prompts)]
    t0 = time.time()
    gens = client.generate(prompt_ids, params, seeds)
    t_gen = time.time() - t0
    batch = RolloutBatch(params.n, max_score=reward_max_score(reward))
    texts, labels, prompt_texts = [], [], []
    for p, text, ids, group in zip(prompts, rendered, prompt_ids, gens):
        for g in group:
            prompt_texts.append(text)
            batch.prompt_ids.append(ids)
            batch.response_ids.append(list(g.output_ids))
            batch.rollout_logprobs.append(list(g.logprobs))
            batch.truncated.append(g.finish_reason == "length")
            batch.prompt_index.append(p.index)
            batch.routed_experts.append(g.routed_experts)
            texts.append(g.text)
            labels.append(p.label)
    t0 = time.time()
    scores = remote.score(prompt_texts, texts, labels) if remote else \
        score_batch(reward, texts, labels, num_workers=reward_workers)
    batch.rewards = [float(r) for r in scores]
    batch.stats = {"time/generate_s": t_gen, "time/reward_s": time.time() - t0}
    if overlong is not None:
        penalties = [overlong.penalty(len(r)) for r in batch.response_ids]
        batch.rewards = [r + p for r, p in zip(batch.rewards, penalties)]
        batch.stats["rollout/overlong_penalty"] = sum(penalties)  # summed over rounds
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    batch.kept = [not (overlong_filter and t) for t in batch.truncated]
    if overlong_filter:
        batch.advantages = kept_group_advantages(rewards, torch.tensor(batch.kept), params.n,
                                                 normalize_std=normalize_std).tolist()
    else:
        batch.advantages = group_advantages(rewards, params.n,
                                            normalize_std=normalize_std).tolist()
    return batch


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


def collect_batch(client: RolloutClient, tokenizer: Any, stream: PromptStream, num_prompts: int,
                  params: SamplingParams, reward: str, *, dynamic_sampling: bool = True,
                  max_rounds: int = 4, normalize_std: bool = True,
                  gen_batch_size: int | None = None, filter_metric: str = "reward",
                  overlong_filter: bool = False,
                  prompt_limit: tuple[int, str] | None = None,
                  remote: RemoteReward | None = None,
                  overlong: OverlongShaping | None = None) -> RolloutBatch:
    """A batch of ``num_prompts`` groups, refilled past zero-advantage groups when asked.

    With dynamic sampling, rounds of ``gen_batch_size`` (default ``num_prompts``) prompts are
    drawn until enough informative groups exist or ``max_rounds`` is reached (then the batch
    may be smaller; Klear: 256 prompts for 128, one round). A group is uninformative when its
    ``filter_metric`` has no spread among its kept responses: ``reward``, or ``acc`` (reward ==
    the reward's maximum; with format penalties a group can have reward spread and no accuracy
    spread). Of more informative groups than needed, the first ``num_prompts`` are kept.
    ``overlong_filter``, ``prompt_limit``: see :func:`generate_and_score`.
    """
    out = RolloutBatch(params.n, max_score=reward_max_score(reward))
    drawn = zero = 0
    all_rewards: list[float] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for _ in range(max_rounds if dynamic_sampling else 1):
        need = num_prompts - out.groups()
        drawn_now = stream.take((gen_batch_size or num_prompts) if dynamic_sampling else need)
        got = generate_and_score(client, tokenizer, [p for _, p in drawn_now], params, reward,
                                 normalize_std=normalize_std,
                                 seeds=[stream.sampling_seed(pos) for pos, _ in drawn_now],
                                 overlong_filter=overlong_filter, prompt_limit=prompt_limit,
                                 remote=remote, overlong=overlong)
        for k, v in got.stats.items():
            out.stats[k] = out.stats.get(k, 0.0) + v
        drawn += got.groups()
        all_rewards += got.rewards
        lengths += [len(r) for r in got.response_ids]
        truncated += got.truncated
        if dynamic_sampling:
            flat = flat_groups(group_filter_values(got, filter_metric),
                               torch.tensor(got.kept), params.n)
            zero += int(flat.sum())
            keep = [g for g in range(got.groups()) if not flat[g]][:need]
            got = got.select_groups(keep)
        out.extend(got)
        if out.groups() >= num_prompts:
            break
    rounds_gen = out.stats.get("time/generate_s", 0.0)
    if "rollout/overlong_penalty" in out.stats:  # mean over every response scored
        out.stats["rollout/overlong_penalty"] /= max(len(all_rewards), 1)
    out.stats.update({
        "rollout/reward_mean": sum(all_rewards) / max(len(all_rewards), 1),
        "rollout/accuracy": sum(r >= out.max_score for r in all_rewards)
        / max(len(all_rewards), 1),
        "rollout/response_len": sum(lengths) / max(len(lengths), 1),
        "rollout/truncation_rate": sum(truncated) / max(len(truncated), 1),
        "rollout/zero_adv_frac": zero / max(drawn, 1),
        "rollout/prompts_drawn": float(drawn),
        "rollout/groups_kept": float(out.groups()),
        "rollout/tokens_per_s": sum(lengths) / max(rounds_gen, 1e-9),
    })
    return out


def group_filter_values(batch: RolloutBatch, metric: str) -> torch.Tensor:
    """Per-response values whose spread makes a group informative: rewards or accuracies."""
    if metric == "reward":
        return torch.tensor(batch.rewards, dtype=torch.float64)
    if metric == "acc":
        return torch.tensor([float(r >= batch.max_score) for r in batch.rewards])
    raise ValueError(f"unknown group filter metric {metric!r}: use reward or acc")


def broadcast_batch(batch: RolloutBatch | None) -> RolloutBatch:
    """Share rank 0's batch with every rank."""
    holder = [batch]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]
