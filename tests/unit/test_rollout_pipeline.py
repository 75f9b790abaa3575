"""The rollout pipeline's stages (rollout/orchestration/pipeline.py) and collect_batch's rounds over them,
against hand-computed values: GRPO advantages over Sample records, a user filter loaded by
import path, the order of the filters, and the refusals of broken stages and specs."""

import math

import pytest

from megatron_klear.data.prompts import PromptSample
from megatron_klear.rollout.orchestration.client import SamplingParams
from megatron_klear.rollout.orchestration.pipeline import RolloutContext, RolloutPipeline, \
    build_pipeline, drop_flat_groups, drop_truncated, grpo_advantages
from megatron_klear.samples import RolloutBatch, Sample
from megatron_klear.train.rl_data import DynamicSamplingFlags, PromptStream, collect_batch
from tests.unit.test_overgeneration import ScriptedClient

HERE = "tests.unit.test_rollout_pipeline"


def has_four(response: str, label) -> float:
    """A reward by import path: 1 when the response mentions 4."""
    return float("4" in response)


def drop_skipped_groups(ctx, samples):
    """A user filter by import path: drops every group with a response saying 'skip'."""
    bad = {s.group for s in samples if "skip" in s.response_text}
    return [s for s in samples if s.group not in bad]


def keep_long(ctx, samples):
    """A user filter that drops single responses (kept=False) shorter than 2 characters."""
    for s in samples:
        if len(s.response_text) < 2:
            s.kept = False
    return samples


def drop_one_sample(ctx, samples):
    """A broken filter: leaves a group with a missing sample."""
    return samples[1:]


def _samples(rewards, kept=None, n=4):
    kept = kept or [True] * len(rewards)
    return [Sample([1], [2], [-0.1], [1], "stop", 0, i // n, reward=r, kept=k)
            for i, (r, k) in enumerate(zip(rewards, kept))]


def _ctx(n, normalize_std=True, **kw):
    return RolloutContext(None, None, SamplingParams(n=n), "math", 1.0,
                          normalize_std=normalize_std, **kw)


def test_grpo_advantages_over_samples_by_hand():
    """Group (1, 0, 0, 0): mean 1/4, unbiased std sqrt(3/16 * 4/3) = 1/2 -> (1.5, -.5 x3);
    group (1, 1, 0, 0): mean 1/2, std sqrt(1/3) -> +-(1/2) sqrt(3)."""
    got = [s.advantage for s in grpo_advantages(_ctx(4), _samples([1, 0, 0, 0, 1, 1, 0, 0]))]
    h = 0.5 * math.sqrt(3)
    assert got == pytest.approx([1.5, -0.5, -0.5, -0.5, h, h, -h, -h], rel=1e-5)
    plain = grpo_advantages(_ctx(4, normalize_std=False), _samples([1, 0, 0, 0]))
    assert [s.advantage for s in plain] == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_grpo_advantages_leave_out_the_samples_a_filter_dropped():
    """(1, -1, 1, [-2 dropped]): kept mean 1/3, unbiased std sqrt(4/3); the dropped one gets 0.
    Negative control: the same rewards all kept give the plain group values instead."""
    s = math.sqrt(4 / 3)
    kept = grpo_advantages(_ctx(4), _samples([1, -1, 1, -2], [True, True, True, False]))
    assert [x.advantage for x in kept] == pytest.approx([(2 / 3) / s, (-4 / 3) / s,
                                                         (2 / 3) / s, 0.0], rel=1e-5)
    mean, std = -0.25, math.sqrt((1.25 ** 2 * 2 + 0.75 ** 2 + 1.75 ** 2) / 3)
    allkept = grpo_advantages(_ctx(4), _samples([1, -1, 1, -2]))
    assert [x.advantage for x in allkept] == pytest.approx(
        [(r - mean) / std for r in (1, -1, 1, -2)], rel=1e-5)


def _prompts(count):
    return [PromptSample(i, [{"role": "user", "content": f"q{i}"}], None) for i in range(count)]


def _collect(script, stages=(), rounds=3):
    from megatron_klear.models.tiny import build_tokenizer

    tok = build_tokenizer()
    prompts = _prompts(len(script))
    order = [p.index for _, p in PromptStream(prompts, 0).take(len(script))]
    stream = PromptStream(prompts, 0)
    batch = collect_batch(ScriptedClient(tok, [[(t, "stop") for t in g] for g in script]), tok,
                          stream, 2, SamplingParams(n=2, max_new_tokens=8), f"{HERE}:has_four",
                          DynamicSamplingFlags(max_gen_rounds=rounds), stages=stages)
    rows = [order.index(i) for i in batch.prompt_index[::2]]   # script rows, in batch order
    return batch, rows, stream.consumed


SCRIPT = [["4", "5"],          # informative
          ["4 skip", "5"],     # informative, but the user filter drops it
          ["4", "4"],          # flat: the group filter drops it
          ["5", "4"]]          # informative


def test_user_filter_by_import_path_drops_its_groups_and_the_batch_refills():
    batch, rows, consumed = _collect(SCRIPT, [f"filter={HERE}:drop_skipped_groups"])
    assert rows == [0, 3] and consumed == 4            # two rounds of 2 prompts
    assert batch.rewards == [1.0, 0.0, 0.0, 1.0]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)                  # (r - 1/2) / (unbiased std + eps)
    assert batch.advantages == pytest.approx([a, -a, -a, a], rel=1e-6)
    assert batch.stats["rollout/zero_adv_frac"] == 0.5     # 2 of the 4 drawn groups dropped
    assert batch.stats["rollout/prompts_drawn"] == 4 and batch.stats["rollout/groups_kept"] == 2
    assert batch.stats["rollout/reward_mean"] == 5 / 8     # over all 8 scored responses
    # negative control: without the user filter the first round already fills the batch
    plain, rows, consumed = _collect(SCRIPT)
    assert rows == [0, 1] and consumed == 2 and plain.stats["rollout/zero_adv_frac"] == 0.0


def test_user_filters_run_before_the_group_filter():
    """keep_long drops the 1-character '5' of ('44', '5'): one kept response, no spread, so
    the group filter then drops the group (without keep_long the group is informative)."""
    script = [["44", "5"], ["4", "44"], ["444", "55"], ["5", "5"]]
    _, rows, _ = _collect(script, [f"filter={HERE}:keep_long"], rounds=2)
    assert rows == [2]                                  # row 1: both '4's -> flat anyway
    _, rows, _ = _collect(script, rounds=2)
    assert rows == [0, 2]
    pipe = build_pipeline([f"filter={HERE}:keep_long"], overlong_filter=True)
    assert pipe.filters == (drop_truncated, keep_long, drop_flat_groups)
    assert build_pipeline(None, dynamic_sampling=False).filters == ()


def test_broken_stages_and_specs_are_refused_by_name():
    ctx = _ctx(2)
    pipe = RolloutPipeline(generate=lambda c, p, s: _samples([1, 0, 1, 1], n=2),
                           score=lambda c, s: s, filters=(drop_one_sample,))
    with pytest.raises(ValueError, match="rollout stage drop_one_sample returned 3 samples"):
        pipe.round(ctx, _prompts(2), [0, 1])
    with pytest.raises(ValueError, match="returned 4 samples that are not 3 groups"):
        pipe.round(ctx, _prompts(3), [0, 1, 2])        # generate answered 2 of 3 prompts
    for spec, msg in [("filtr=x", "expected KIND=STAGE"), ("filter", "expected KIND=STAGE"),
                      ("filter=nope", "unknown rollout stage 'nope'"),
                      ("filter=tests.no_such_module:fn", "cannot load rollout stage"),
                      (f"filter={HERE}:HERE", "is not callable")]:
        with pytest.raises(ValueError, match=msg):
            build_pipeline([spec])
    with pytest.raises(ValueError, match="the advantages stage is given twice"):
        build_pipeline(["advantages=grpo", "advantages=grpo"])
    masked = _samples([1, 0], n=2)
    assert RolloutBatch.from_samples(masked, 2, 1.0, {}).rewards == [1, 0]
    masked[1].response_ids, masked[1].loss_mask = [2, 3], [1]      # one mask value short
    with pytest.raises(ValueError, match="sample 1: its loss_mask must hold one 0 or 1"):
        RolloutBatch.from_samples(masked, 2, 1.0, {})


def test_rollout_stages_flag_is_checked_at_parse_time():
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    required = ["--hf-checkpoint", "x", "--prompt-data", "x"]
    with pytest.raises(ConfigError, match="unknown rollout stage 'nope'"):
        parse_config(RLConfig, required + ["--rollout-stages", "filter=nope"])
    cfg = parse_config(RLConfig, required + ["--rollout-stages", f"filter={HERE}:keep_long",
                                             "advantages=grpo"])
    assert cfg.rollout_stages == [f"filter={HERE}:keep_long", "advantages=grpo"]
