"""The pure-torch spec (ops/loss_math.py) is exact in the dtype it is given, and the official
Klear arithmetic is reproduced operation for operation.

* float64 hand tables at 1e-12: clipped GPPO / PPO tokens, dual clip (c = 3 and Klear's c = 10),
  ERC's asymmetric band and its log-ratio clamp, the entropy ratio in float64;
* a plain re-implementation of Kwai-Klear/KlearReasoner's ``compute_gppo_loss_general_beta``
  (verl/trainer/ppo/core_algos.py at 3422f6d: boolean-mask assignments, ``torch.min`` dual
  clip) agrees bit for bit in float32 and float64;
* ``aggregate_rl_loss`` against hand values for every ``--loss-aggregation`` and, for
  ``token-mean-micro``, against a plain float64 re-implementation of the official actor's
  per-micro-batch arithmetic (verl/workers/actor/dp_actor.py ``update_policy``: masked_mean
  with the integer response mask, the positive-sample NLL over ``reward == correct_score``
  rows, ``coeff * positive + pg``, times ``len(micro) / ppo_mini_batch_size``), bit for bit.
"""

import pytest
import torch

from megatron_klear.ops.loss_math import (AggregationTotals, MicroCounts, aggregate_rl_loss,
                                          entropy_ratio_mask, per_token_policy_loss)

F64 = torch.float64
EPS_L, EPS_H = 0.2, 0.28          # neither is a float32 number: a float32 constant shows


def _grad(name, ratio, adv, dtype=F64, **kw):
    """(loss, d loss / d logp) per token with old log-prob -1.3 and the given ratios."""
    ratio = torch.as_tensor(ratio, dtype=dtype)
    adv = torch.as_tensor(adv, dtype=dtype)
    old = torch.full_like(ratio, -1.3)
    logp = (old + torch.log(ratio)).requires_grad_(True)
    loss = per_token_policy_loss(name, logp, old, adv, eps_low=EPS_L, eps_high=EPS_H, **kw)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), g


# (ratio, advantage) -> by hand for beta1 = 0.3, beta2 = 1.7, dual clip c:
#   low  (A < 0, r < 0.8):   value = grad = -0.3 * 0.8 * A
#   high (A > 0, r > 1.28):  value = grad = -1.7 * 1.28 * A
#   inside:                  value = grad = -r A
#   dual (A < 0, loss > -c A): value -c A, grad 0
ROWS = [(0.5, -1.5), (1.6, 2.0), (1.1, 0.7), (0.9, -0.3), (0.5, 1.2), (1.6, -1.0),
        (12.0, -0.5), (4.0, -0.5)]


def _hand(c):
    out = []
    for r, a in ROWS:
        if a < 0 and r < 1 - EPS_L:
            v = g = -0.3 * (1 - EPS_L) * a
        elif a > 0 and r > 1 + EPS_H:
            v = g = -1.7 * (1 + EPS_H) * a
        else:
            v = g = -r * a
        if a < 0 and v > -c * a:
            v, g = -c * a, 0.0
        out.append((v, g))
    return out


@pytest.mark.parametrize("c", [3.0, 10.0])
def test_gppo_float64_hand_table_at_1e_12(c):
    loss, grad = _grad("gppo", [r for r, _ in ROWS], [a for _, a in ROWS], beta1=0.3, beta2=1.7,
                       dual_clip=c)
    exp = torch.tensor(_hand(c), dtype=F64)
    torch.testing.assert_close(loss, exp[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, exp[:, 1], rtol=1e-12, atol=1e-12)
    assert loss.dtype == F64


def test_ppo_float64_clipped_value_exact():
    loss, grad = _grad("ppo", [0.5, 1.6], [-1.5, 2.0], dual_clip=10.0)
    torch.testing.assert_close(loss, torch.tensor([0.8 * 1.5, -1.28 * 2.0], dtype=F64),
                               rtol=1e-15, atol=0)
    assert torch.count_nonzero(grad) == 0


def official_general_beta(old_log_prob, log_prob, advantages, cliprange_low, cliprange_high,
                          clip_ratio_c, beta1, beta2):
    """Per-token losses of KlearReasoner's compute_gppo_loss_general_beta, re-implemented
    with the same operations in the same order (before its agg_loss)."""
    ratio = torch.exp(log_prob - old_log_prob)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - cliprange_low)) & (advantages < 0)
    high_mask = (ratio > (1 + cliprange_high)) & (advantages > 0)
    other_mask = ~(low_mask | high_mask)
    clip1 = torch.zeros_like(advantages)
    clip1[low_mask] = (-beta1 * (1 - cliprange_low) / ratio_detached[low_mask]
                       * ratio[low_mask] * advantages[low_mask])
    clip1[high_mask] = (-beta2 * (1 + cliprange_high) / ratio_detached[high_mask]
                        * ratio[high_mask] * advantages[high_mask])
    clip1[other_mask] = -ratio[other_mask] * advantages[other_mask]
    clip2 = torch.min(-advantages * clip_ratio_c, clip1)
    return torch.where(advantages < 0, clip2, clip1)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gppo_equals_the_official_general_beta_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4000, generator=g, dtype=F64) * 5
    logp = old + torch.randn(4000, generator=g, dtype=F64) * 0.6
    adv = torch.randn(4000, generator=g, dtype=F64)
    old, logp, adv = old.to(dtype), logp.to(dtype), adv.to(dtype)
    kw = dict(eps_low=EPS_L, eps_high=EPS_H, beta1=0.75, beta2=1.3, dual_clip=10.0)
    ours = per_token_policy_loss("gppo", logp, old, adv, **kw)
    ref = official_general_beta(old, logp, adv, EPS_L, EPS_H, 10.0, 0.75, 1.3)
    assert ours.dtype == dtype and torch.equal(ours, ref)
    # gradients too (the dual-capped tokens have none in both; no ties in this data)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(per_token_policy_loss("gppo", a, old, adv, **kw).sum(), a)
    (gb,) = torch.autograd.grad(official_general_beta(old, b, adv, EPS_L, EPS_H, 10.0, 0.75,
                                                      1.3).sum(), b)
    assert torch.equal(ga, gb)


# ERC with the asymmetric band (0.9, 1.3): (H, H_old, kept)
ERC_BAND = [(1.2, 1.0, True),      # 1.2 < 1.3: kept (a symmetric delta 0.1 would drop it)
            (0.85, 1.0, False),    # below 0.9
            (1.0, 1.0, True)]


def test_erc_asymmetric_band_and_log_ratio_clamp_by_hand():
    """Rows: ERC band rows (log r = log 1.1, A = 0.7: inside, value = grad = -1.1 * 0.7 unless
    ERC drops the gradient), then log r = +25 with A = 1 (clamped to e^20: high clip, value
    -1.28, gradient 0 through the clamp) and log r = -25 with A = -1 (low clip, value 0.8,
    gradient 0). Without ERC the last two keep GPPO's gradients -1.28 and 0.8."""
    ent = torch.tensor([e[0] for e in ERC_BAND] + [1.0, 1.0], dtype=F64)
    old_ent = torch.tensor([e[1] for e in ERC_BAND] + [1.0, 1.0], dtype=F64)
    old = torch.full((5,), -30.0, dtype=F64)
    logp = (old + torch.tensor([1.1, 1.1, 1.1, 1.0, 1.0], dtype=F64).log()
            + torch.tensor([0, 0, 0, 25.0, -25.0], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([0.7, 0.7, 0.7, 1.0, -1.0], dtype=F64)
    loss = per_token_policy_loss("gppo", logp, old, adv, eps_low=EPS_L, eps_high=EPS_H,
                                 entropy=ent, old_entropy=old_ent, erc_low=0.9, erc_high=1.3)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    v = -1.1 * 0.7
    torch.testing.assert_close(loss.detach(), torch.tensor([v, v, v, -1.28, 0.8], dtype=F64),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor([v, 0, v, 0, 0], dtype=F64), rtol=1e-12,
                               atol=1e-12)
    plain = per_token_policy_loss("gppo", logp, old, adv, eps_low=EPS_L, eps_high=EPS_H)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    torch.testing.assert_close(g_plain[3:], torch.tensor([-1.28, 0.8], dtype=F64), rtol=1e-12,
                               atol=0)


def test_erc_entropy_ratio_in_the_input_dtype():
    """rho = 1.05 - 1e-12 is inside (0.95, 1.05) in float64; in float32 it rounds to the bound
    and is outside: the spec must compare in the dtype it is given."""
    old = torch.tensor([1.0], dtype=F64)
    ent = (old + 1e-8) * (1.05 - 1e-12) - 1e-8
    assert entropy_ratio_mask(ent, old, 0.05).item()
    assert not entropy_ratio_mask(ent.float(), old.float(), 0.05).item()


def test_erc_band_errors():
    args = (torch.zeros(2), torch.zeros(2), torch.ones(2))
    kw = dict(entropy=torch.ones(2), old_entropy=torch.ones(2))
    with pytest.raises(ValueError, match="not both"):
        per_token_policy_loss("gppo", *args, entropy_ratio_clip=0.1, erc_low=0.9, erc_high=1.1,
                              **kw)
    with pytest.raises(ValueError, match="erc_low and erc_high must both"):
        per_token_policy_loss("gppo", *args, erc_low=0.9, **kw)
    with pytest.raises(ValueError, match="erc_low < erc_high"):
        per_token_policy_loss("gppo", *args, erc_low=1.1, erc_high=0.9, **kw)


# ------------------------------------------------------------------ aggregation

# one micro-batch of 3 responses (rows), response length 4; reward 1 = max score on rows 0, 2
POLICY = [[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]
NLL = [[0.1, 0.2, 0.3, 0.4], [5.0, 5.0, 0.0, 0.0], [0.6, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
POS = [1.0, 0.0, 1.0]


def _agg(mode, totals, micro=None):
    policy, nll = torch.tensor(POLICY, dtype=F64), torch.tensor(NLL, dtype=F64)
    mask = torch.tensor(MASK, dtype=torch.float32)
    pos = torch.tensor(POS)[:, None].expand(3, 4)
    seq_tokens = mask.sum(1, keepdim=True).expand(3, 4)
    return aggregate_rl_loss(mode, policy, nll, mask, pos, 0.1, totals, seq_tokens=seq_tokens,
                             micro=micro)


@pytest.mark.parametrize("mode,pg,sft", [
    # token sums: policy 10 + 0 + 2 = 12 over 7 tokens; SFT 1.0 + 0.6 = 1.6 over 5 tokens
    ("token-mean", 12 / 20, 1.6 / 10),                            # mini-batch: 20 / 10 tokens
    ("seq-mean-token-sum", (10 + 0 + 2) / 6, (1.0 + 0.6) / 4),   # 6 responses, 4 positive
    ("seq-mean-token-mean", (10 / 4 + 0 / 2 + 2 / 1) / 6, (1.0 / 4 + 0.6 / 1) / 4),
    # micro: (12 / 7 and 1.6 / 5) x 3 sequences / (12 / 2 ranks) per rank / 2 ranks
    ("token-mean-micro", 12 / 7 * 3 / 6 / 2, 1.6 / 5 * 3 / 6 / 2)])
def test_aggregations_by_hand(mode, pg, sft):
    totals = AggregationTotals(tokens=20, positive_tokens=10, sequences=6 if "seq" in mode
                               else 12, positive_sequences=4, dp_size=2)
    micro = MicroCounts(torch.tensor(7), torch.tensor(5), torch.tensor(3))
    total, got_pg, got_sft = _agg(mode, totals, micro)
    assert got_pg.item() == pytest.approx(pg, rel=1e-12)
    assert got_sft.item() == pytest.approx(sft, rel=1e-12)
    assert total.item() == pytest.approx(pg + 0.1 * sft, rel=1e-12)


def official_micro_loss(pg_losses, log_prob, response_mask, reward, correct_score, coeff,
                        ppo_mini_batch_size):
    """One micro-batch's loss of KlearReasoner's dp_actor.update_policy (dynamic batch size),
    re-implemented operation for operation; ``response_mask`` is verl's int64 mask."""
    def masked_mean(values, mask):
        return (values * mask).sum() / (mask.sum() + 1e-8)

    positive = reward == correct_score
    positive_loss = torch.tensor(0)
    if positive.any():
        positive_loss = masked_mean(-1.0 * log_prob[positive], response_mask[positive])
    pg_loss = masked_mean(pg_losses, response_mask)
    policy_loss = coeff * positive_loss + pg_loss
    return policy_loss * (len(pg_losses) / ppo_mini_batch_size)


@pytest.mark.parametrize("rewards", [[1.0, -1.0, -0.5, 1.0, -2.0, -1.0, 1.0, 1.0],
                                     [-1.0] * 8])
def test_token_mean_micro_is_the_official_arithmetic_bit_for_bit(rewards):
    g = torch.Generator().manual_seed(7)
    rows, length = 8, 32
    pg = torch.randn(rows, length, generator=g, dtype=F64)
    logp = -torch.rand(rows, length, generator=g, dtype=F64) * 4
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(torch.int64)
    reward = torch.tensor(rewards, dtype=F64)
    ref = official_micro_loss(pg, logp, mask, reward, 1.0, 0.1, ppo_mini_batch_size=64)
    positive = (reward == 1.0)[:, None].expand(rows, length)
    micro = MicroCounts(mask.sum(), (mask * positive).sum(), torch.tensor(rows))
    totals = AggregationTotals(tokens=0, positive_tokens=0, sequences=64, positive_sequences=0,
                               dp_size=1)
    total, _, _ = aggregate_rl_loss("token-mean-micro", pg, -1.0 * logp, mask.float(), positive,
                                    0.1, totals, micro=micro)
    assert total.dtype == F64 and torch.equal(total, ref)


def test_unknown_aggregation_and_missing_inputs():
    totals = AggregationTotals(1, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        _agg("seq-mean", totals)
    with pytest.raises(ValueError, match="micro-batch's counts"):
        _agg("token-mean-micro", totals)
