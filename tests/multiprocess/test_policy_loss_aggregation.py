"""Token-level aggregation: one mini-batch gives the same gradient as 1 or 4 micro-batches, and
at DP=1 or DP=2, when every micro-batch divides by the mini-batch token count
(``global_token_count``) and gradients are summed. Negative control: per-micro-batch means
(the default normalizer) give a different gradient when micro-batches hold different counts."""

import pytest
import torch
import torch.distributed as dist

from megatron_klear.ops.loss_math import global_token_count, sft_loss
from megatron_klear.ops import vocab_parallel_policy_loss
from tests.dist import run_distributed

B, S, H, V, ALPHA = 8, 6, 16, 67, 0.1


def _batch() -> dict:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 1, 4, 2, 6, 3, 5, 1])   # uneven token counts per sequence
    mask = torch.arange(S)[None, :] < lengths[:, None]
    return dict(h=torch.randn(B, S, H, generator=g), w=torch.randn(H, V, generator=g) * 0.5,
                targets=torch.randint(0, V, (B, S), generator=g), mask=mask,
                old=-torch.rand(B, S, generator=g) * 4 - 1, adv=torch.randn(B, generator=g) * 2,
                positive=torch.tensor([1, 0, 0, 1, 0, 1, 0, 0]).bool()[:, None] & mask)


def _grad(batch: dict, micro: list[slice], backend: str, group=None, global_norm: bool = True
          ) -> torch.Tensor:
    """Summed gradient of W over ``micro`` micro-batches (GPPO + alpha * SFT on positives)."""
    w = batch["w"].clone().requires_grad_(True)
    masks = [batch["mask"][m] for m in micro]
    positives = [batch["positive"][m] for m in micro]
    norm = global_token_count(masks, group) if global_norm else None
    pos_norm = global_token_count(positives, group) if global_norm else None
    for m, mask, pos in zip(micro, masks, positives):
        out = vocab_parallel_policy_loss(batch["h"][m] @ w, batch["targets"][m], batch["old"][m],
                                         batch["adv"][m], mask, backend=backend, normalizer=norm)
        (out.loss + ALPHA * sft_loss(out.logprobs, pos, pos_norm)).backward()
    if group is not None:
        dist.all_reduce(w.grad, group=group)
    return w.grad


def _quarters() -> list[slice]:
    return [slice(i, i + 2) for i in range(0, B, 2)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_one_vs_four_micro_batches(backend):
    batch = _batch()
    whole = _grad(batch, [slice(0, B)], backend)
    torch.testing.assert_close(_grad(batch, _quarters(), backend), whole, rtol=1e-5, atol=1e-6)
    # negative control: the per-micro-batch mean weights tokens of short micro-batches more
    per_micro_mean = _grad(batch, _quarters(), backend, global_norm=False) / 4
    assert (per_micro_mean - whole).abs().max() > 1e-3


def _dp_rank(rank: int, world_size: int, backends: list[str]) -> list[float]:
    batch = _batch()
    mine = _quarters()[rank::world_size]
    errors = []
    for backend in backends:
        whole = _grad(batch, [slice(0, B)], backend)
        dp = _grad(batch, mine, backend, group=dist.group.WORLD)
        torch.testing.assert_close(dp, whole, rtol=1e-5, atol=1e-6)
        errors.append(float((dp - whole).abs().max()))
    return errors


def test_dp2_matches_dp1():
    errors = run_distributed(_dp_rank, 2, ["torch", "cpu"])
    assert len(errors[0]) == 2 and max(max(e) for e in errors) < 1e-6
