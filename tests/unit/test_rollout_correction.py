"""Rollout correction (``--rollout-correction``): weights and masks per mode and level on
constructed log-probs, against values computed by hand with math.exp; the same weights in the
padded and the THD-packed layouts of the trainer; the config flags and their errors."""

import math

import pytest
import torch

from megatron_klear.algo.rollout_correction import RolloutCorrection, rollout_correction_weights
from megatron_klear.config import ConfigError, parse_config

# Two sequences; d = old_logp - rollout_logp on their response tokens. A prompt token (mask 0)
# with a huge d and the pack's padding must not enter any ratio.
D_A, D_B = [0.1, -0.2, 0.9], [-1.0, 0.3]
TOKEN = [math.exp(d) for d in D_A + D_B]                      # 1.105 0.819 2.460 0.368 1.350
SEQ = [math.exp(0.8)] * 3 + [math.exp(-0.7)] * 2              # 2.226 (A), 0.497 (B)
GEO = [math.exp(0.8 / 3)] * 3 + [math.exp(-0.35)] * 2         # 1.306 (A), 0.705 (B)
RHO = {"token": TOKEN, "sequence": SEQ, "geometric": GEO}

# (mode, cap, lower) -> level -> expected weights of the five response tokens, by hand
EXPECTED = {
    ("tis", None, None): {"token": [TOKEN[0], TOKEN[1], 2.0, TOKEN[3], TOKEN[4]],
                          "sequence": [2.0] * 3 + SEQ[3:], "geometric": GEO},
    ("tis", 1.2, None): {"token": [TOKEN[0], TOKEN[1], 1.2, TOKEN[3], 1.2],
                         "sequence": [1.2] * 3 + SEQ[3:], "geometric": [1.2] * 3 + GEO[3:]},
    ("mis", None, None): {"token": [TOKEN[0], TOKEN[1], 0.0, TOKEN[3], TOKEN[4]],
                          "sequence": [0.0] * 3 + SEQ[3:], "geometric": GEO},
    ("mis", 2.0, 0.5): {"token": [TOKEN[0], TOKEN[1], 0.0, 0.0, TOKEN[4]],
                        "sequence": [0.0] * 5, "geometric": GEO},
    ("icepop", None, None): {"token": [TOKEN[0], TOKEN[1], TOKEN[2], 0.0, TOKEN[4]],
                             "sequence": SEQ[:3] + [0.0, 0.0], "geometric": GEO},
    ("icepop", 1.2, 0.75): {"token": [TOKEN[0], TOKEN[1], 0.0, 0.0, 0.0],
                            "sequence": [0.0] * 5, "geometric": [0.0] * 5},
}


def _padded():
    """[2, 5] rows: a prompt token, then the responses (right padding)."""
    rollout = torch.tensor([[-9.0, -1.0, -2.0, -0.5, 0.0], [-9.0, -3.0, -0.25, 0.0, 0.0]])
    d = torch.tensor([[40.0] + D_A + [0.0], [40.0] + D_B + [0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float)
    ids = torch.arange(2)[:, None].expand(2, 5)
    return rollout + d, rollout, mask, ids


def _packed():
    """The same sequences in one THD pack [1, 9]: A (4 labels), B (3 labels), 2 padding."""
    old, rollout, mask, _ = _padded()
    take = [(0, slice(0, 4)), (1, slice(0, 3))]
    cat = lambda t: torch.cat([t[r, s] for r, s in take] + [torch.zeros(2)])[None]  # noqa: E731
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1, -1]])
    old_p = cat(old)
    old_p[0, 7:] = 30.0      # padding: large d, but mask 0
    return old_p, cat(rollout), cat(mask), ids


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("setting", list(EXPECTED), ids=str)
def test_weights_per_mode_and_level_by_hand(setting, level):
    spec = RolloutCorrection(setting[0], level, setting[1], setting[2])
    want = torch.tensor(EXPECTED[setting][level])
    for old, rollout, mask, ids in (_padded(), _packed()):
        w, m = rollout_correction_weights(old, rollout, mask, ids, spec)
        assert w.shape == old.shape and w.dtype == torch.float32
        assert torch.count_nonzero(w[mask == 0]) == 0
        torch.testing.assert_close(w[mask > 0], want, rtol=1e-6, atol=1e-7)
        rho = torch.tensor(RHO[level])
        rejected = float(((want == 0) & (rho > 0)).sum()) / 5 if setting[0] != "tis" else 0.0
        truncated = float((rho > spec.upper).sum()) / 5 if setting[0] == "tis" else 0.0
        assert m["weight_mean"].item() == pytest.approx(float(want.mean()), rel=1e-6)
        assert m["rejected_frac"].item() == pytest.approx(rejected)
        assert m["truncated_frac"].item() == pytest.approx(truncated)


def test_defaults_and_bad_values_name_the_flag():
    assert (RolloutCorrection("tis").upper, RolloutCorrection("tis").low) == (2.0, None)
    assert (RolloutCorrection("mis").upper, RolloutCorrection("mis").low) == (2.0, None)
    assert (RolloutCorrection("icepop").upper, RolloutCorrection("icepop").low) == (5.0, 0.5)
    bad = [(("pop",), "--rollout-correction 'pop'"), (("none",), "--rollout-correction 'none'"),
           (("tis", "batch"), "--rollout-correction-level 'batch'"),
           (("mis", "token", 0.0), "--rollout-correction-cap must be > 0"),
           (("tis", "token", 2.0, 0.5), "--rollout-correction-lower applies to mis and icepop"),
           (("icepop", "token", None, 6.0), "--rollout-correction-lower 6.0 must be in")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            RolloutCorrection(*args)


def test_huge_sequence_ratio_stays_finite():
    """exp(sum d) overflows to inf: tis truncates it to the cap, mis rejects it (no NaN)."""
    old, rollout, mask = torch.full((1, 4), 300.0), torch.zeros(1, 4), torch.ones(1, 4)
    ids = torch.zeros(1, 4, dtype=torch.long)
    for mode, want in (("tis", 2.0), ("mis", 0.0)):
        w, _ = rollout_correction_weights(old, rollout, mask, ids, RolloutCorrection(mode,
                                                                                     "sequence"))
        assert torch.equal(w, torch.full((1, 4), want))


def _rl_batch():
    from megatron_klear.samples import RolloutBatch

    b = RolloutBatch(group_size=2)
    g = torch.Generator().manual_seed(3)
    for i, (lp, lr) in enumerate([(4, 3), (4, 5), (6, 2), (6, 4)]):
        b.prompt_ids.append(torch.randint(3, 90, (lp,), generator=g).tolist())
        b.response_ids.append(torch.randint(3, 90, (lr,), generator=g).tolist())
        b.rollout_logprobs.append((-torch.rand(lr, generator=g)).tolist())
        b.rewards.append(float(i % 2))
        b.advantages.append(1.0 - 2 * (i % 2))
        b.prompt_index.append(i // 2)
        b.truncated.append(False)
    return b


def test_trainer_layouts_give_each_sequence_its_weight():
    """The trainer's sequence ids (algo/rl_objective.sequence_ids) in THD packs and padded
    micro-batches: the per-sequence geometric / sequence weights come out the same, sequence
    by sequence."""
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.data.microbatches import pack_microbatches, pad_microbatches
    from megatron_klear.algo.rl_objective import sequence_ids

    batch = _rl_batch()
    shift = [0.3, -0.4, 0.05, 1.2]            # old - rollout, the same on every token of sample i
    cfg = RLConfig(hf_checkpoint="x", prompt_data="x", micro_batch_size=2, mini_batch_size=2,
                   rollout_batch_size=2, n_samples_per_prompt=2, max_tokens_per_gpu=14)
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    layouts = {"packed": pack_microbatches(batch, range(4), cfg.micro_batch_layout(), 0),
               "padded": pad_microbatches(batch, range(4), 2, 0, seq_len)}
    assert len(layouts["packed"]) > 1 and any(mb["segment_ids"].max() > 0
                                              for mb in layouts["packed"])
    lengths = [len(r) for r in batch.response_ids]        # distinct: they identify a sample
    assert len(set(lengths)) == len(lengths)
    for level, want in (("sequence", [math.exp(s * n) for s, n in zip(shift, lengths)]),
                        ("geometric", [math.exp(s) for s in shift])):
        spec = RolloutCorrection("icepop", level, cap=1e9, lower=0.0)   # w = rho, no mask
        for name, mbs in layouts.items():
            got = {}
            for mb in mbs:
                ids, mask = sequence_ids(mb), mb["loss_mask"] > 0
                old = mb["rollout_logprobs"].clone()
                samples = {}
                for row in torch.unique(ids[mask]).tolist():
                    samples[row] = lengths.index(int((mask & (ids == row)).sum()))
                    old[ids == row] += shift[samples[row]]
                w, _ = rollout_correction_weights(old, mb["rollout_logprobs"], mb["loss_mask"],
                                                  ids, spec)
                for row, i in samples.items():
                    got[i] = w[mask & (ids == row)].unique().tolist()
            assert sorted(got) == [0, 1, 2, 3], name
            for i in range(4):
                assert got[i] == pytest.approx([want[i]], rel=1e-5), (name, level, i)


REQUIRED = ["--hf-checkpoint", "x", "--prompt-data", "x"]


@pytest.mark.parametrize("argv,msg", [
    (["--entropy-ratio-clip", "0"], "--entropy-ratio-clip must be > 0"),
    (["--entropy-ratio-clip", "-0.05"], "--entropy-ratio-clip must be > 0"),
    (["--tis-cap", "2", "--rollout-correction", "mis"], "--tis-cap C is an alias"),
    (["--tis-cap", "0"], "--tis-cap must be > 0"),
    (["--rollout-correction-cap", "2"], "need --rollout-correction tis, mis or icepop"),
    (["--rollout-correction", "tis", "--rollout-correction-lower", "0.5"],
     "--rollout-correction-lower applies"),
    (["--rollout-correction", "mis", "--rollout-correction-cap", "-1"],
     "--rollout-correction-cap must be > 0"),
])
def test_rl_flags_errors_name_the_flag(argv, msg):
    from megatron_klear.train.rl import RLConfig

    with pytest.raises(ConfigError, match=msg):
        parse_config(RLConfig, REQUIRED + argv)


def test_rl_flags_parse_and_unknown_choices(tmp_path):
    from megatron_klear.train.rl import RLConfig

    cfg = parse_config(RLConfig, REQUIRED + ["--loss-type", "cispo", "--entropy-ratio-clip",
                                             "0.05", "--rollout-correction", "icepop",
                                             "--rollout-correction-level", "geometric"])
    assert (cfg.loss_type, cfg.entropy_ratio_clip) == ("cispo", 0.05)
    assert cfg.correction() == RolloutCorrection("icepop", "geometric")
    assert parse_config(RLConfig, REQUIRED + ["--tis-cap", "1.5"]).correction() == \
        RolloutCorrection("tis", "token", 1.5)
    assert parse_config(RLConfig, REQUIRED).correction() is None
    for key, value in (("loss-type", "grpo"), ("rollout-correction", "is"),
                       ("rollout-correction-level", "batch")):
        y = tmp_path / "c.yaml"
        y.write_text(f"{key}: {value}\n")
        with pytest.raises(ConfigError, match=f"--{key}: '{value}' is not one of"):
            parse_config(RLConfig, REQUIRED + ["--config", str(y)])
        with pytest.raises(SystemExit):      # argparse: "argument --loss-type: invalid choice"
            parse_config(RLConfig, REQUIRED + [f"--{key}", value])


def test_policy_loss_section_builds_the_ops_spec_field_by_field():
    """The section hands the fused op one PolicyLossSpec; each flag lands in its own field."""
    from megatron_klear.algo.rl_objective import PolicyLossFlags
    from megatron_klear.ops import PolicyLossSpec
    from megatron_klear.train.rl import RLConfig

    cfg = parse_config(RLConfig, REQUIRED + [
        "--loss-type", "ppo", "--eps-clip-low", "0.11", "--eps-clip-high", "0.33",
        "--gppo-beta1", "0.4", "--gppo-beta2", "1.7", "--dual-clip", "3.5",
        "--erc-low", "0.9", "--erc-high", "1.2"])
    assert cfg.part(PolicyLossFlags).spec() == PolicyLossSpec(
        loss_type="ppo", eps_low=0.11, eps_high=0.33, beta1=0.4, beta2=1.7, dual_clip=3.5,
        entropy_ratio_clip=None, erc_low=0.9, erc_high=1.2)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        parse_config(RLConfig, REQUIRED + ["--dual-clip", "0.5"]).part(PolicyLossFlags).spec()
