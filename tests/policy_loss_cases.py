"""Shared inputs and comparisons for the fused policy-loss op tests (TP=1, TP=2, aggregation).

``make_inputs`` builds one deterministic problem (full-vocabulary logits, targets, behaviour
log-probs, advantages, mask); ``run_op`` runs the op on (a shard of) it and returns the loss,
per-token outputs and the gradient of ``loss + w1 . logprobs + w2 . entropy`` w.r.t. the logits
shard, so that every differentiable output's backward path is exercised. Backend ``cuda-emu``
is the CUDA kernel source run on the CPU (tests/cuda_emu.py). ``reference64`` is the fp64
specification of log-probs, entropy and gradient; ``ulp`` the spacing of a storage dtype.
"""

from __future__ import annotations

import torch

from megatron_klear.ops import vocab_parallel_policy_loss
from tests.cuda_emu import backend_for

# Backends checked against the torch reference on this machine (cuda joins on a GPU machine).
FUSED = [("cpu", "cpu"), ("cpu", "cuda-emu")] + \
    ([("cuda", "cuda")] if torch.cuda.is_available() else [])
# bf16 / fp16: 2 ulps relative (both sides round fp32 math to the storage dtype), and an
# absolute floor far below the gradients' scale (~1e-4 / V per element here).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-7),
       torch.float16: dict(rtol=2 ** -10, atol=1e-7)}


def make_inputs(tokens: int, vocab: int, *, vocab_size: int | None = None, seed: int = 0,
                empty_mask: bool = False) -> dict:
    """Random logits [tokens, vocab] (scale 3: peaked rows) and matching per-token inputs."""
    g = torch.Generator().manual_seed(seed)
    valid = vocab if vocab_size is None else vocab_size
    mask = torch.rand(tokens, generator=g) > 0.25
    return dict(logits=torch.randn(tokens, vocab, generator=g) * 3,
                targets=torch.randint(0, valid, (tokens,), generator=g),
                old=-torch.rand(tokens, generator=g) * 6 - 1,
                adv=torch.randn(tokens, generator=g),
                mask=torch.zeros_like(mask) if empty_mask else mask,
                w_logp=torch.randn(tokens, generator=g) * 0.1,
                w_ent=torch.randn(tokens, generator=g) * 0.1)


def run_op(inp: dict, logits: torch.Tensor, *, backend: str, device: str = "cpu", **kw) -> dict:
    """Run the op on ``logits`` (a shard or the full row) and collect outputs + gradient."""
    x = logits.detach().to(device).clone().requires_grad_(True)
    dev = {k: v.to(device) for k, v in inp.items() if k != "logits"}
    with backend_for(backend) as used:
        out = vocab_parallel_policy_loss(x, dev["targets"], dev["old"], dev["adv"], dev["mask"],
                                         backend=used, compute_entropy=True, **kw)
        total = out.loss + (dev["w_logp"] * out.logprobs).sum() + \
            (dev["w_ent"] * out.entropy).sum()
        total.backward()
    res = dict(loss=out.loss, logprobs=out.logprobs, entropy=out.entropy, ratio=out.ratio,
               grad=x.grad, **{f"m_{k}": v for k, v in out.metrics.items()})
    return {k: v.detach().float().cpu() for k, v in res.items()}


def assert_match(got: dict, ref: dict, dtype: torch.dtype, what: str) -> None:
    """Every output of ``got`` matches ``ref`` to the tolerance of ``dtype``."""
    assert got.keys() == ref.keys()
    for key in ref:
        assert torch.isfinite(got[key]).all(), f"{what}: {key} is not finite"
        torch.testing.assert_close(got[key], ref[key], **TOL[dtype], msg=lambda m: f"{what}: "
                                   f"{key}: {m}")


def reference64(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float,
                g_logp: torch.Tensor, g_ent: torch.Tensor) -> dict:
    """fp64 lse, logp, entropy [T] and d(g_logp . logp + g_ent . H)/dlogits [T, V] of the
    stored logits (padding columns >= vocab_size are -inf and get zero gradient)."""
    x = logits.double() / temperature
    x[:, vocab_size:] = float("-inf")
    lse = torch.logsumexp(x, -1)
    logp_all = x - lse[:, None]
    p = logp_all.exp()
    plogp = torch.where(p > 0, p * logp_all, 0.0)
    entropy = -plogp.sum(-1)
    onehot = torch.nn.functional.one_hot(targets, logits.shape[1]).double()
    g_logp, g_ent = g_logp.double()[:, None], g_ent.double()[:, None]
    grad = (g_logp * (onehot - p) - g_ent * (plogp + p * entropy[:, None])) / temperature
    # Scale of the largest term of each gradient element (its rounding error is relative to it).
    terms = (g_logp.abs() * (onehot + p) + g_ent.abs() * (plogp.abs() + p * entropy[:, None].abs())
             ) / temperature
    return dict(lse=lse, logp=logp_all.gather(1, targets[:, None])[:, 0], entropy=entropy,
                grad=grad.masked_fill(torch.isinf(x), 0.0), grad_terms=terms)


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at |values| (fp64), subnormal spacing near zero."""
    info = torch.finfo(dtype)
    mag = values.abs().double().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps

