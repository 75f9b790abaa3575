"""GSPO: the sequence-level ratio against hand values (value and gradient, clipped and not),
and the fused log-prob path against the torch spec."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_klear.ops.loss_math import per_token_policy_loss, sequence_mean
from megatron_klear.ops import PolicyLossSpec, vocab_parallel_policy_loss

D = torch.float64


def test_sequence_mean_ignores_masked_tokens():
    values = torch.tensor([1.0, 2.0, 9.0, 3.0, 5.0, 7.0], dtype=D)
    ids = torch.tensor([0, 0, -1, 2, 2, 2])
    mask = torch.tensor([1, 1, 0, 1, 1, 0])
    assert sequence_mean(values, ids, mask).tolist() == [1.5, 1.5, 0.0, 4.0, 4.0, 0.0]


def test_gspo_hand_table():
    # sequence 0: log r = (0.1, -0.3) -> mean -0.1, s0 = e^-0.1 = 0.9048 < 1 - 0.05: clipped
    #   for A = +1 the min picks the unclipped -s A (PPO: max of the two losses) -> gradient s0;
    # sequence 1: log r = (0.02, 0.0, 0.01) -> mean 0.01, s1 = e^0.01 = 1.01005 > 1 + 0.004 with
    #   A = +2: clipped, value -(1.004)(2), gradient 0.  A padding token (mask 0) in between.
    old = torch.zeros(6, dtype=D)
    logp = torch.tensor([0.1, -0.3, 5.0, 0.02, 0.0, 0.01], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 0.0, 2.0, 2.0, 2.0], dtype=D)
    ids = torch.tensor([0, 0, -1, 1, 1, 1])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=D)
    loss = per_token_policy_loss("gspo", logp, old, adv, eps_low=0.05, eps_high=0.004,
                                 sequence_ids=ids, loss_mask=mask)
    s0 = math.exp(-0.1)
    want = [-s0, -s0, None, -1.004 * 2, -1.004 * 2, -1.004 * 2]
    for got, w in zip(loss.tolist(), want):
        if w is not None:
            assert got == pytest.approx(w, rel=1e-14)
    (grad,) = torch.autograd.grad((loss * mask).sum(), logp)
    assert grad.tolist() == pytest.approx([-s0, -s0, 0.0, 0.0, 0.0, 0.0], rel=1e-14, abs=0)
    # A < 0 and s below 1 - eps: the clipped value is the larger loss -> zero gradient
    neg = per_token_policy_loss("gspo", logp, old, -adv, eps_low=0.05, eps_high=0.004,
                                sequence_ids=ids, loss_mask=mask)
    assert neg[0].item() == pytest.approx(0.95, rel=1e-14)
    (grad,) = torch.autograd.grad((neg * mask)[:2].sum(), logp)
    assert grad[:2].abs().max() == 0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fused_logprobs_path_matches_spec(backend):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=g, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=g)
    with torch.no_grad():
        exact = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = exact + 0.01 * torch.randn(2, 7, generator=g)
    adv = torch.tensor([1.0, -1.0])[:, None].expand(2, 7).contiguous()
    mask = (torch.rand(2, 7, generator=g) > 0.2).float()
    ids = torch.arange(2)[:, None].expand(2, 7)
    out = vocab_parallel_policy_loss(logits, targets, old, adv, mask,
                                     PolicyLossSpec("gspo", eps_low=3e-3, eps_high=4e-3),
                                     sequence_ids=ids, backend=backend)
    out.loss.backward()
    logp = torch.log_softmax(logits.detach().double(), -1).gather(-1, targets[..., None])[..., 0]
    logp.requires_grad_(True)
    spec = per_token_policy_loss("gspo", logp.flatten(), old.double().flatten(),
                                 adv.double().flatten(), eps_low=3e-3, eps_high=4e-3,
                                 sequence_ids=ids.flatten(), loss_mask=mask.flatten())
    want = (spec * mask.double().flatten()).sum() / mask.sum()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    with pytest.raises(ValueError, match="needs sequence_ids"):
        vocab_parallel_policy_loss(logits, targets, old, adv, mask, PolicyLossSpec("gspo"))
