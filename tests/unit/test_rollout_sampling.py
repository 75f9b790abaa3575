"""Sampling numerics of the embedded server against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_klear.rollout.engine.sampling import (filter_top_k_top_p, find_stop_string,
                                                    sample_next, seeded_uniforms, token_logprobs)
from megatron_klear.rollout.orchestration.request import RequestError, SamplingParams

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def _kept(top_k: int, top_p: float) -> list[int]:
    out = filter_top_k_top_p(PROBS.log(), top_k, top_p)
    return torch.nonzero(torch.isfinite(out))[:, 0].tolist()


@pytest.mark.parametrize("top_k, top_p, kept", [
    (-1, 1.0, [0, 1, 2, 3]),
    (2, 1.0, [1, 3]),
    (-1, 0.45, [1]),         # 0.5 alone reaches 0.45
    (-1, 0.75, [1, 3]),      # 0.5 + 0.3 reaches 0.75: 0.15 is dropped
    (-1, 0.81, [1, 2, 3]),
    (3, 0.81, [1, 2, 3]),
    (1, 1.0, [1]),
])
def test_top_k_top_p_keep_hand_computed_sets(top_k, top_p, kept):
    assert _kept(top_k, top_p) == kept


def test_temperature_scaled_logprobs():
    logits = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    lp = token_logprobs(logits, torch.tensor([2.0, 0.0]))
    z = math.exp(0.5) + math.exp(1.0) + math.exp(2.0)
    assert lp[0, 2].item() == pytest.approx(2.0 - math.log(z), abs=1e-6)
    z1 = math.exp(1.0) + math.exp(2.0) + math.exp(4.0)  # temperature 0 -> unscaled
    assert lp[1, 2].item() == pytest.approx(4.0 - math.log(z1), abs=1e-6)


@pytest.mark.parametrize("draws", ["generator", "seeded"])
def test_sampling_follows_the_filtered_distribution(draws):
    """Inverse-CDF sampling at the row's uniform draw follows the top-k filtered distribution,
    with draws from a torch generator or from the (seed, position) counter stream."""
    cfg = SamplingParams(top_k=2)
    rows = PROBS.log().expand(4000, 4)
    if draws == "generator":
        u = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    else:  # 4000 positions of one seed
        u = seeded_uniforms(torch.full((4000,), 123), torch.arange(4000))
    tokens = sample_next(rows, [cfg] * 4000, u)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=0.03, rtol=0)
    greedy = sample_next(rows[:3], [SamplingParams(temperature=0.0)] * 3, u[:3])
    assert greedy.tolist() == [1, 1, 1]


def test_rows_keep_their_own_sampling_config():
    """One batch mixing greedy, top-p and top-k rows: each row samples only its own kept set
    (the hand-computed sets above), whatever its draw."""
    cfgs = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.45),
            SamplingParams(top_k=2), SamplingParams(top_p=0.75)]
    kept = [{1}, {1}, {1, 3}, {1, 3}]
    seen: list[set] = [set() for _ in cfgs]
    for u in torch.linspace(0.0, 0.999, 200, dtype=torch.float64):
        tokens = sample_next(PROBS.log().expand(4, 4), cfgs, u.expand(4))
        for row, tok in enumerate(tokens.tolist()):
            seen[row].add(tok)
    assert seen == kept


def test_seeded_draws_depend_on_seed_and_position_only():
    seeds, pos = torch.tensor([5, 5, 6, 2**40 + 5]), torch.tensor([10, 11, 10, 10])
    u = seeded_uniforms(seeds, pos)
    assert len(set(u.tolist())) == 4  # seed, position and the seed's high bits all matter
    assert seeded_uniforms(seeds[[2, 0]], pos[[2, 0]]).tolist() == [u[2].item(), u[0].item()]
    many = seeded_uniforms(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert 0.0 <= many.min() and many.max() < 1.0
    hist = torch.histc(many.float(), bins=10, min=0.0, max=1.0) / 20000
    torch.testing.assert_close(hist, torch.full((10,), 0.1), atol=0.01, rtol=0)


def _fmix32_spec(h: int) -> int:
    """MurmurHash3's fmix32 on Python ints, written from the reference (the spec)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seeded_draws_are_the_documented_hash():
    """The stream itself is fixed (a seeded rollout replays across versions and servers): each
    draw equals the (seed, position) hash computed on Python ints, incl. seeds using all 63
    bits and positions past 2**32 (only their low 32 bits count)."""
    seeds = [0, 1, 123, 2**32 + 7, 2**40 + 5, 2**63 - 1]
    positions = [0, 1, 10, 2**31, 2**32 + 3, 987654321]
    got = seeded_uniforms(torch.tensor(seeds), torch.tensor(positions)).tolist()
    for seed, pos, u in zip(seeds, positions, got):
        key = _fmix32_spec(_fmix32_spec(seed & 0xFFFFFFFF) ^ (seed >> 32))
        h1 = _fmix32_spec(key ^ _fmix32_spec(pos & 0xFFFFFFFF))
        h2 = _fmix32_spec(h1 ^ 0x9E3779B9)
        assert u == ((h1 << 21) + (h2 >> 11)) / 2.0**53, (seed, pos)


def test_earliest_stop_string_wins():
    assert find_stop_string("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop_string("abc", ["x"]) is None


@pytest.mark.parametrize("params, field", [
    ("x", "sampling_params must be a JSON object"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams.from_request(params)


def test_single_stop_string_accepted():
    assert SamplingParams.from_request({"stop": "END"}).stop == ["END"]
