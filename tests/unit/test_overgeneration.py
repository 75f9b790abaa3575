"""Klear's over-generation without refill, the accuracy group filter and the overlong filter
(rl_data.collect_batch, algo/advantages.py, rl.trainable_groups), against hand tables."""

import math

import pytest
import torch

from megatron_klear.algo.advantages import flat_groups, kept_group_advantages
from megatron_klear.data.prompts import PromptSample
from megatron_klear.rollout.orchestration.client import Generation
from megatron_klear.train.rl_data import DynamicSamplingFlags, PromptStream, collect_batch


def test_kept_group_advantages_by_hand():
    """Group 1 keeps rewards 1, -1, 1 of (1, -1, 1, -2): mean 1/3, unbiased std sqrt(4/3);
    group 2 keeps one response: all 0."""
    rewards = torch.tensor([1.0, -1.0, 1.0, -2.0, 1.0, -1.0, -1.0, -1.0])
    keep = torch.tensor([True, True, True, False, True, False, False, False])
    adv = kept_group_advantages(rewards, keep, 4, eps=0.0)
    s = math.sqrt(4 / 3)
    torch.testing.assert_close(adv, torch.tensor([(2 / 3) / s, (-4 / 3) / s, (2 / 3) / s, 0,
                                                  0, 0, 0, 0]))


def test_accuracy_filter_sees_no_spread_where_the_reward_has_some():
    """(-1, -0.5, -2, -1): wrong answers with format penalties: reward spread, no accuracy
    spread; (1, -1, -1, -1) has both; (1, 1, 1, 1) neither."""
    rewards = torch.tensor([-1.0, -0.5, -2.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    keep = torch.ones(12, dtype=torch.bool)
    acc = (rewards >= 1.0).double()
    assert flat_groups(rewards, keep, 4).tolist() == [False, False, True]
    assert flat_groups(acc, keep, 4).tolist() == [True, False, True]
    keep[4] = False   # the overlong filter dropped the only correct response of group 2
    assert flat_groups(acc, keep, 4).tolist() == [True, True, True]


def test_trainable_groups_rounds_like_the_official_trainer():
    from megatron_klear.train.rl import RLConfig, trainable_groups

    refill = RLConfig(rollout_batch_size=128, mini_batch_size=16, n_samples_per_prompt=8)
    assert trainable_groups(refill, 100, 8) == 96          # whole mini-batches
    klear = RLConfig(rollout_batch_size=128, mini_batch_size=16, n_samples_per_prompt=8,
                     rollout_gen_batch_size=256, max_gen_rounds=1)
    assert trainable_groups(klear, 150, 8) == 128          # the first 128 groups
    assert trainable_groups(klear, 101, 8) == 101          # 808 responses split over 8
    assert trainable_groups(klear, 101, 16) == 100         # 800 over 16 ranks
    klear.n_samples_per_prompt = 3
    assert trainable_groups(klear, 7, 4) == 4              # 12 responses over 4 ranks


class ScriptedClient:
    """Stands in for rollout/orchestration/client.py RolloutClient.generate: one list of n Generations per
    prompt, taken in order from a script (text, finish reason) so the rewards are chosen."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []

    def generate(self, prompt_ids, params, seeds=None):
        self.calls.append(len(prompt_ids))
        out = []
        for _ in prompt_ids:
            group = self.script.pop(0)
            assert len(group) == params.n
            out.append([Generation(text, self.tokenizer(text)["input_ids"], [-0.5] * len(
                self.tokenizer(text)["input_ids"]), reason, "0", 3) for text, reason in group])
        return out


RIGHT, WRONG = "<think>ok</think> \\boxed{4}", "<think>ok</think> \\boxed{5}"
UNCLOSED, BARE = "<think>still going", "\\boxed{5}</think> \\boxed{5}"


def test_collect_batch_overgenerates_once_and_keeps_the_first_informative_groups():
    from megatron_klear.models.tiny import build_tokenizer
    from megatron_klear.rollout.orchestration.client import SamplingParams

    tok = build_tokenizer()
    stop, length = "stop", "length"
    script = [
        [(WRONG, stop), (UNCLOSED, length), (BARE, stop)],   # reward spread, no acc spread
        [(RIGHT, stop), (WRONG, stop), (WRONG, stop)],       # informative
        [(RIGHT, length), (WRONG, stop), (WRONG, stop)],     # informative unless overlong
        [(RIGHT, stop), (RIGHT, stop), (WRONG, stop)],       # informative
        [(RIGHT, stop), (RIGHT, stop), (RIGHT, stop)],       # flat
        [(WRONG, stop), (RIGHT, stop), (RIGHT, stop)],       # informative (4th)
    ]
    prompts = [PromptSample(i, [{"role": "user", "content": f"q{i}"}], "4") for i in range(6)]
    params = SamplingParams(n=3, max_new_tokens=64)

    def collect(overlong, metric):
        """The k-th prompt drawn gets script[k]; returns the batch's script rows."""
        stream = PromptStream(prompts, seed=0)
        order = [p.index for _, p in PromptStream(prompts, seed=0).take(6)]
        client = ScriptedClient(tok, script)
        batch = collect_batch(client, tok, stream, 2, params, "math_klear",
                              DynamicSamplingFlags(max_gen_rounds=1, rollout_gen_batch_size=6,
                                                   filter_groups_metric=metric,
                                                   overlong_filter=overlong))
        assert client.calls == [6] and stream.consumed == 6      # one round, no refill
        assert batch.groups() == 2 and batch.stats["rollout/prompts_drawn"] == 6
        return batch, sorted({order.index(i) for i in batch.prompt_index})

    assert collect(False, "acc")[1] == [1, 2]       # the first two informative groups
    assert collect(False, "reward")[1] == [0, 1]    # row 0 has reward spread
    filtered, rows = collect(True, "acc")           # row 2 loses its only RIGHT (no EOS)
    assert rows == [1, 3] and all(filtered.kept)


def test_overlong_filter_drops_responses_without_eos():
    from megatron_klear.models.tiny import build_tokenizer
    from megatron_klear.rollout.orchestration.client import SamplingParams
    from megatron_klear.data.microbatches import sample_fields

    tok = build_tokenizer()
    prompts = [PromptSample(0, [{"role": "user", "content": "q"}], "4")]
    client = ScriptedClient(tok, [[(RIGHT, "stop"), (WRONG, "stop"), (RIGHT, "length"),
                                   (WRONG, "stop")]])
    batch = collect_batch(client, tok, PromptStream(prompts, 0), 1,
                          SamplingParams(n=4, max_new_tokens=64), "math_klear",
                          DynamicSamplingFlags(max_gen_rounds=1, filter_groups_metric="acc",
                                               overlong_filter=True), prompt_limit=(5, "left"))
    assert batch.kept == [True, True, False, True]
    full = tok(tok.apply_chat_template(prompts[0].messages, tokenize=False,
                                       add_generation_prompt=True))["input_ids"]
    assert len(full) > 5 and batch.prompt_ids[0] == full[-5:]    # left-truncated prompt
    s = math.sqrt(4 / 3)   # kept rewards 1, -1, -1: mean -1/3
    assert batch.advantages == pytest.approx([(4 / 3) / s, (-2 / 3) / s, 0.0, (-2 / 3) / s],
                                             rel=1e-5)
    assert max(sample_fields(batch, 2)[1]["loss_mask"]) == 0.0   # no loss tokens
    assert sample_fields(batch, 2)[1]["positive"][-1] == 0.0     # and not an SFT positive


def test_prompt_left_truncation_and_error():
    from megatron_klear.rollout.orchestration.pipeline import limit_prompt

    sample = PromptSample(7, [], None)
    ids = list(range(10))
    assert limit_prompt(ids, sample, (4, "left")) == [6, 7, 8, 9]      # keeps the end
    assert limit_prompt(ids, sample, (10, "error")) == ids
    assert limit_prompt(ids, sample, (4, "off")) == ids
    with pytest.raises(ValueError, match="prompt 7 has 10 tokens.*--truncate-prompt left"):
        limit_prompt(ids, sample, (4, "error"))
