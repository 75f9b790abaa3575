"""Per-token policy losses, SFT loss and aggregation against values computed by hand.

Each case of the GPPO table (docs/ARCHITECTURE.md) is one token; the expected loss values and
d loss / d logp are written out from the table, not computed by the code under test. CE-GPPO's
beta scales the VALUE of clipped tokens as well as their gradient (Klear's official
``compute_gppo_loss_general_beta``: ``-beta * bound / sg(r) * r * A``).
"""

import math

import pytest
import torch

from megatron_klear.ops.loss_math import (POLICY_LOSSES, aggregate, per_token_policy_loss,
                                          policy_loss, sft_loss)

EPS_L, EPS_H, C = 0.2, 0.28, 3.0
# (ratio, advantage, case)
CASES = [(0.5, -1.5, "low"),      # A < 0 and r < 1 - eps_l
         (1.6, 2.0, "high"),      # A > 0 and r > 1 + eps_h
         (4.0, -0.5, "dual"),     # A < 0 and r > c
         (1.1, 0.7, "inside"),    # trust region, A > 0
         (0.9, -0.3, "inside"),   # trust region, A < 0
         (0.5, 1.2, "inside"),    # r < 1 - eps_l but A > 0: not clipped
         (1.6, -1.0, "inside")]   # r > 1 + eps_h but A < 0 (below c): not clipped


def _run(name, **kw):
    """Per-token loss, d loss / d logp and logp of CASES (old log-prob -1.3)."""
    ratio = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    old = torch.full_like(ratio, -1.3)
    logp = (old + torch.log(ratio)).requires_grad_(True)
    loss = per_token_policy_loss(name, logp, old, adv, eps_low=EPS_L, eps_high=EPS_H, **kw)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), grad, logp.detach()


def _expected(r, a, case, *, grad_through_clip, beta1=1.0, beta2=1.0, dual=True):
    """(value, d/dlogp) straight from the GPPO / PPO table."""
    if case == "low":
        v = -(1 - EPS_L) * a
        return beta1 * v if grad_through_clip else v, beta1 * v if grad_through_clip else 0.0
    if case == "high":
        v = -(1 + EPS_H) * a
        return beta2 * v if grad_through_clip else v, beta2 * v if grad_through_clip else 0.0
    if case == "dual" and dual:
        return -C * a, 0.0
    return -r * a, -r * a


@pytest.mark.parametrize("name,kw,through", [
    ("gppo", {}, True), ("gppo", {"beta1": 0.5, "beta2": 2.0}, True),
    ("gppo", {"beta1": 0.75, "beta2": 1.0}, True), ("ppo", {}, False)])
def test_clip_cases_match_table(name, kw, through):
    loss, grad, _ = _run(name, dual_clip=C, **kw)
    exp = [_expected(r, a, c, grad_through_clip=through, **kw) for r, a, c in CASES]
    torch.testing.assert_close(loss, torch.tensor([e[0] for e in exp], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([e[1] for e in exp], dtype=torch.float64))


def test_ce_gppo_beta_scales_the_clipped_value_by_hand():
    """beta1 = 0.75 (CE-GPPO's scripts): the low token's value is 0.75 * 0.8 * 1.5 = 0.9."""
    loss, grad, _ = _run("gppo", beta1=0.75, beta2=1.0)
    assert loss[0].item() == pytest.approx(0.9) and grad[0].item() == pytest.approx(0.9)
    assert loss[1].item() == pytest.approx(-1.28 * 2.0) and grad[1].item() == pytest.approx(-2.56)


def test_dual_clip_caps_the_loss_value_as_the_official_min():
    """Dual clip = min(-c A, loss) for A < 0: with beta1 (1 - eps_l) > c the low case caps too.

    beta1 = 5: low token value 5 * 0.8 * 1.5 = 6 > c |A| = 4.5 -> 4.5, zero gradient; the high
    token (A > 0) is untouched; the inside token with r = 1.6 < c is untouched."""
    loss, grad, _ = _run("gppo", beta1=5.0, dual_clip=C)
    assert loss[0].item() == pytest.approx(4.5) and grad[0].item() == 0
    assert loss[1].item() == pytest.approx(-2.56) and grad[1].item() == pytest.approx(-2.56)
    assert loss[6].item() == pytest.approx(1.6) and grad[6].item() == pytest.approx(1.6)
    loss, grad, _ = _run("gppo", beta1=3.0, dual_clip=C)     # 3 * 0.8 * 1.5 = 3.6 < 4.5
    assert loss[0].item() == pytest.approx(3.6) and grad[0].item() == pytest.approx(3.6)


# ERC (arXiv 2512.05591), delta = 0.05: (H, H_old) per token of CASES -> kept (1) or not (0).
ERC_DELTA = 0.05
ERC_ENTROPIES = [(1.0, 1.0, 1),      # rho = 1
                 (1.04, 1.0, 1),     # rho = 1.04 < 1.05
                 (2.12, 2.0, 0),     # rho = 1.06
                 (0.96, 1.0, 1),     # rho = 0.96 > 0.95
                 (0.47, 0.5, 0),     # rho = 0.94
                 (0.0, 0.0, 1),      # (0 + 1e-8) / (0 + 1e-8) = 1
                 (1e-9, 0.0, 0)]     # (1e-9 + 1e-8) / 1e-8 = 1.1: the 1e-8 matters


@pytest.mark.parametrize("name,through", [("gppo", True), ("ppo", False), ("cispo", None)])
def test_entropy_ratio_clip_masks_the_gradient_not_the_value(name, through):
    ent = torch.tensor([e[0] for e in ERC_ENTROPIES], dtype=torch.float64)
    old_ent = torch.tensor([e[1] for e in ERC_ENTROPIES], dtype=torch.float64)
    keep = torch.tensor([float(e[2]) for e in ERC_ENTROPIES], dtype=torch.float64)
    kw = {} if name == "cispo" else {"dual_clip": C}
    loss, grad, logp = _run(name, entropy=ent, old_entropy=old_ent,
                            entropy_ratio_clip=ERC_DELTA, **kw)
    if name == "cispo":
        w = [min(max(r, 1 - EPS_L), 1 + EPS_H) for r, _, _ in CASES]
        exp = [(-c * a * lp, -c * a) for c, (_, a, _), lp in zip(w, CASES, logp.tolist())]
    else:
        exp = [_expected(r, a, c, grad_through_clip=through) for r, a, c in CASES]
    torch.testing.assert_close(loss, torch.tensor([e[0] for e in exp], dtype=torch.float64))
    torch.testing.assert_close(grad, keep * torch.tensor([e[1] for e in exp],
                                                         dtype=torch.float64))
    ent.requires_grad_(True)    # the entropies are not differentiated
    _, g_ent = torch.autograd.grad(
        per_token_policy_loss(name, logp.requires_grad_(True), logp.detach(), torch.ones(7),
                              entropy=ent, old_entropy=old_ent,
                              entropy_ratio_clip=ERC_DELTA).sum(), (logp, ent),
        allow_unused=True)
    assert g_ent is None


def test_entropy_ratio_clip_bad_values():
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError, match="entropy_ratio_clip .*must be > 0"):
            _run("gppo", entropy=torch.ones(7), old_entropy=torch.ones(7),
                 entropy_ratio_clip=bad)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        _run("gppo", entropy_ratio_clip=0.05)


def test_without_dual_clip_large_ratio_is_unclipped():
    loss, grad, _ = _run("gppo")
    r, a, _ = CASES[2]
    assert loss[2].item() == pytest.approx(-r * a) and grad[2].item() == pytest.approx(-r * a)


def test_ppo_zero_gradient_and_gppo_bounded_gradient_on_clipped_tokens():
    _, g_ppo, _ = _run("ppo")
    _, g_gppo, _ = _run("gppo")
    assert g_ppo[0] == 0 and g_ppo[1] == 0
    assert g_gppo[0].item() == pytest.approx(-(1 - EPS_L) * -1.5)
    assert g_gppo[1].item() == pytest.approx(-(1 + EPS_H) * 2.0)


def test_cispo_hand_computed():
    loss, grad, logp = _run("cispo")
    clipped = [min(max(r, 1 - EPS_L), 1 + EPS_H) for r, _, _ in CASES]
    adv = [a for _, a, _ in CASES]
    torch.testing.assert_close(grad, torch.tensor([-c * a for c, a in zip(clipped, adv)],
                                                  dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor([-c * a * lp for c, a, lp in
                                                   zip(clipped, adv, logp.tolist())],
                                                  dtype=torch.float64))
    with pytest.raises(ValueError, match="dual_clip"):
        _run("cispo", dual_clip=C)


def test_registry_and_unknown_name():
    assert {"ppo", "gppo", "cispo"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        per_token_policy_loss("grpo", torch.zeros(2), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        _run("ppo", dual_clip=0.5)


def test_policy_loss_aggregates_and_reports_metrics():
    logp = torch.log(torch.tensor([0.5, 1.6, 1.1, 1.0]))
    old = torch.zeros(4)
    adv = torch.tensor([-1.0, 2.0, 1.0, 5.0])
    mask = torch.tensor([1, 1, 1, 0])
    loss, m = policy_loss("gppo", logp, old, adv, mask)
    assert loss.item() == pytest.approx((0.8 * 1.0 - 1.28 * 2.0 - 1.1) / 3, rel=1e-6)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 3)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 1.6 + 1.1) / 3, rel=1e-6)
    kl = sum(r - 1 - math.log(r) for r in (0.5, 1.6, 1.1)) / 3
    assert m["approx_kl"].item() == pytest.approx(kl, rel=1e-5)
    loss10, _ = policy_loss("gppo", logp, old, adv, mask, normalizer=10)
    assert loss10.item() == pytest.approx(loss.item() * 3 / 10, rel=1e-6)


def test_sft_loss_and_empty_mask():
    logp = torch.tensor([-1.0, -2.0, -4.0], requires_grad=True)
    assert sft_loss(logp, torch.tensor([1, 0, 1])).item() == pytest.approx(2.5)
    assert sft_loss(logp, torch.tensor([1, 0, 1]), normalizer=5).item() == pytest.approx(1.0)
    per_token = torch.tensor([float("inf"), 1.0], requires_grad=True)
    empty = aggregate(per_token, torch.zeros(2))
    empty.backward()
    assert empty.item() == 0 and torch.equal(per_token.grad, torch.zeros(2))
