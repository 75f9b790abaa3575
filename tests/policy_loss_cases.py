"""Shared inputs and comparisons for the fused policy-loss op tests (TP=1, TP=2, aggregation).

``make_inputs`` builds one deterministic problem (full-vocabulary logits, targets, behaviour
log-probs and entropies, advantages, mask); ``run_op`` runs the op on (a shard of) it and
returns the loss, per-token outputs and the gradient of ``loss + w1 . logprobs + w2 . entropy``
w.r.t. the logits shard, so that every differentiable output's backward path is exercised. Backend ``cuda-emu``
is the CUDA kernel source run on the CPU (tests/cuda_emu.py). ``reference64`` is the fp64
specification of log-probs, entropy and gradient; ``ulp`` the spacing of a storage dtype.
``hand_table`` is one small problem per case of the loss tables (GPPO / PPO / CISPO, dual clip,
ERC) with its expected loss and gradient written out with math.exp / math.log.
"""

from __future__ import annotations

import math
from dataclasses import fields

import torch

from megatron_klear.ops import PolicyLossSpec, vocab_parallel_policy_loss
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
    """Random logits [tokens, vocab] (scale 3: peaked rows) and matching per-token inputs.

    ``old_ent`` (ERC's behaviour entropy) is the rows' entropy at temperature 1 divided by 0.5,
    1 or 2 per token, so that the entropy ratio is ~2, ~1 or ~0.5: far from ERC's bounds
    1 -/+ 0.1 whatever the backend or storage dtype."""
    g = torch.Generator().manual_seed(seed)
    valid = vocab if vocab_size is None else vocab_size
    mask = torch.rand(tokens, generator=g) > 0.25
    inp = dict(logits=torch.randn(tokens, vocab, generator=g) * 3,
               targets=torch.randint(0, valid, (tokens,), generator=g),
               old=-torch.rand(tokens, generator=g) * 6 - 1,
               adv=torch.randn(tokens, generator=g),
               mask=torch.zeros_like(mask) if empty_mask else mask,
               w_logp=torch.randn(tokens, generator=g) * 0.1,
               w_ent=torch.randn(tokens, generator=g) * 0.1)
    ratio = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (tokens,), generator=g)]
    logp_all = torch.log_softmax(inp["logits"][:, :valid].double(), -1)
    inp["old_ent"] = (-(logp_all.exp() * logp_all).sum(-1) / ratio).float()
    return inp


SPEC_FIELDS = {f.name for f in fields(PolicyLossSpec)}


def run_op(inp: dict, logits: torch.Tensor, *, backend: str, device: str = "cpu", **kw) -> dict:
    """Run the op on ``logits`` (a shard or the full row) and collect outputs + gradient;
    ``kw`` mixes the loss's hyper-parameters (the spec's fields) and the op's other arguments,
    as the parametrized settings list them."""
    x = logits.detach().to(device).clone().requires_grad_(True)
    dev = {k: v.to(device) for k, v in inp.items() if k != "logits"}
    spec = PolicyLossSpec(**{k: kw.pop(k) for k in SPEC_FIELDS & kw.keys()})
    if spec.band is not None:
        kw["old_entropy"] = dev["old_ent"]
    with backend_for(backend) as used:
        out = vocab_parallel_policy_loss(x, dev["targets"], dev["old"], dev["adv"], dev["mask"],
                                         spec, backend=used, compute_entropy=True, **kw)
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



EPS_L, EPS_H, DUAL_C = 0.2, 0.28, 3.0
# (ratio, advantage, case) per row; ERC_DROP: rows whose old entropy is set so that ERC's ratio
# H / H_old is 2 or 0.5 (outside any delta < 0.5), the other rows have ratio 1.
HAND_CASES = [(0.5, -1.5, "low"), (1.6, 2.0, "high"), (4.0, -0.5, "dual"), (1.1, 0.7, "in"),
              (0.9, -0.3, "in")]
HAND_ROWS = [[1.0, -0.5, 2.0, 0.25, 0.0, -1.0], [0.3, 0.3, -1.0, 1.5, 2.5, 0.5],
             [-2.0, 0.0, 1.0, 0.5, 0.1, 0.7], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
             [0.5, -0.25, 1.25, -3.0, 0.0, 2.0]]
HAND_TARGETS = [0, 3, 2, 4, 5]       # in both halves of the 6 columns (TP=2 shards of 3)
ERC_FACTOR = {1: 2.0, 3: 0.5}        # row -> H / H_old


def _hand_row(row: list[float], target: int) -> tuple[float, list[float], float]:
    """(logp of the target, probabilities, entropy) of one row of logits, by hand."""
    lse = math.log(sum(math.exp(v) for v in row))
    p = [math.exp(v - lse) for v in row]
    return row[target] - lse, p, -sum(q * math.log(q) for q in p)


def _hand_token(loss_type: str, r: float, a: float, case: str, logp: float, beta1: float,
                beta2: float) -> tuple[float, float]:
    """(loss value, d loss / d logp) of one token from the tables of docs/policy_loss.md."""
    if loss_type == "cispo":
        w = min(max(r, 1 - EPS_L), 1 + EPS_H)
        return -w * a * logp, -w * a
    if case == "dual":
        return -DUAL_C * a, 0.0
    if case == "in":
        return -r * a, -r * a
    bound, beta = (1 - EPS_L, beta1) if case == "low" else (1 + EPS_H, beta2)
    if loss_type == "ppo":
        return -bound * a, 0.0
    return -beta * bound * a, -beta * bound * a


def hand_table(loss_type: str, beta1: float = 1.0, beta2: float = 1.0,
               erc: float | None = None) -> dict:
    """Inputs of the op for HAND_CASES and the expected mean loss and d loss / d logits [5, 6]
    (dual clip c = 3 for ppo / gppo; ERC zeroes the gradient of the ERC_FACTOR rows)."""
    old, old_ent, exp_loss, exp_grad = [], [], 0.0, []
    n = len(HAND_CASES)
    for i, ((r, a, case), row, t) in enumerate(zip(HAND_CASES, HAND_ROWS, HAND_TARGETS)):
        logp, p, entropy = _hand_row(row, t)
        old.append(logp - math.log(r))
        old_ent.append(entropy / ERC_FACTOR.get(i, 1.0))
        value, dlogp = _hand_token(loss_type, r, a, case, logp, beta1, beta2)
        if erc is not None and i in ERC_FACTOR:
            dlogp = 0.0
        exp_loss += value / n
        exp_grad.append([dlogp / n * ((j == t) - q) for j, q in enumerate(p)])
    spec = PolicyLossSpec(loss_type, EPS_L, EPS_H, beta1, beta2,
                          None if loss_type == "cispo" else DUAL_C, entropy_ratio_clip=erc)
    return dict(logits=torch.tensor(HAND_ROWS), targets=torch.tensor(HAND_TARGETS),
                old=torch.tensor(old), adv=torch.tensor([a for _, a, _ in HAND_CASES]),
                old_ent=torch.tensor(old_ent), spec=spec, loss=exp_loss,
                grad=torch.tensor(exp_grad), ratio=torch.tensor([r for r, _, _ in HAND_CASES]))


HAND_SETTINGS = [("gppo", 1.0, 1.0, None), ("gppo", 0.5, 2.0, None), ("gppo", 0.75, 1.0, None),
                 ("ppo", 1.0, 1.0, None), ("cispo", 1.0, 1.0, None), ("gppo", 0.75, 1.0, 0.05),
                 ("ppo", 1.0, 1.0, 0.05), ("cispo", 1.0, 1.0, 0.05)]


def run_hand_table(table: dict, logits: torch.Tensor, *, backend: str, device: str = "cpu",
                   tp_group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logits, ratio) of the op on ``logits`` (the table's or a TP shard)."""
    x = logits.detach().to(device).clone().requires_grad_(True)
    spec = table["spec"]
    old_ent = table["old_ent"].to(device) if spec.band is not None else None
    with backend_for(backend) as used:
        out = vocab_parallel_policy_loss(
            x, table["targets"].to(device), table["old"].to(device), table["adv"].to(device),
            torch.ones(len(HAND_CASES), device=device), spec, old_entropy=old_ent,
            backend=used, tp_group=tp_group)
        out.loss.backward()
    return out.loss.detach().cpu(), x.grad.cpu(), out.ratio.cpu()
