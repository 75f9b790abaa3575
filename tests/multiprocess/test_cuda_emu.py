"""Emulated-CUDA tier: the CUDA kernels (csrc/cuda/vocab_logprobs.cu compiled as host C++, see
tests/cuda_emu.py) against an fp64 reference on shapes that reach their hard paths.

* vocab shards in the tens of thousands (every stats thread rescales its running sums; the
  backward grid has grid.y > 1), both the 16-byte vector kernels and the scalar fallback
  (rows shifted off 16-byte alignment), bf16 / fp16 / fp32;
* tensor parallelism simulated on one device: each shard's stats, merged as the op merges the
  all-gathered stats (``merge_shard_stats``), with a shard that is all padding and targets
  outside every shard but one; out-of-shard reads are caught by a guard band of large logits;
* rows of a T=32768 x V=151,936 tensor on both sides of 2^31 and 2^32 elements, addressed
  through the real row offsets but stored in a small buffer (only those blocks are launched);
* gradients within 1 ulp of the fp64 reference rounded to the storage dtype, bitwise
  determinism, and a mutation test: each planted bug (KLEAR_MUTATION=k) fails these checks.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import pytest
import torch

from megatron_klear.ops.vocab_parallel import merge_shard_stats
from tests.cpu_kernel_copies import check_every_lower_copy
from tests.cuda_emu import MUTATIONS, build, emulated_ops
from tests.policy_loss_cases import reference64, ulp

GUARD_VALUE = 25.0   # logits of the guard band around every shard (a read there shows)


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    tokens: int
    shard: int          # V/TP: columns per shard (padding included)
    tp: int
    vocab_size: int     # real columns of the whole vocabulary
    temperature: float = 1.0
    offset: int = 0     # elements between an aligned address and row 0 (odd: fallback kernels)
    inplace: bool = False


CASES = [
    Case("bf16-tp1-qwen3-vocab", torch.bfloat16, 3, 151936, 1, 151669),
    Case("bf16-tp1-vector", torch.bfloat16, 5, 40000, 1, 39989, temperature=0.8),
    Case("bf16-tp4-padding-shard", torch.bfloat16, 4, 12288, 4, 2 * 12288 + 5003, inplace=True),
    Case("fp16-tp2-unaligned-fallback", torch.float16, 4, 20000, 2, 39000, 1.3, offset=1),
    Case("fp32-tp3-vector", torch.float32, 4, 9000, 3, 27000, 0.7, inplace=True),
    Case("bf16-tp2-unaligned-fallback", torch.bfloat16, 3, 16000, 2, 31000, offset=3,
         inplace=True),
]


def _problem(case: Case, seed: int = 0) -> dict:
    """Full logits [T, TP * V/TP] in the storage dtype: even rows random and peaked, odd rows
    ramp up along the row (each thread's max keeps growing: one rescale per vector pair)."""
    g = torch.Generator().manual_seed(seed)
    width = case.tp * case.shard
    x = torch.randn(case.tokens, width, generator=g) * 3
    x[1::2] += torch.linspace(0, 12, width)
    return dict(logits=x.to(case.dtype),
                targets=torch.randint(0, case.vocab_size, (case.tokens,), generator=g),
                g_logp=torch.randn(case.tokens, generator=g),
                g_ent=torch.randn(case.tokens, generator=g) * 0.5)


def _guarded(shard: torch.Tensor, guard: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): the shard copied into a buffer with ``guard`` guard elements (value
    GUARD_VALUE) on both sides, row 0 at ``guard + offset`` elements (guard: multiple of 8)."""
    buf = torch.full((2 * guard + offset + shard.numel(),), GUARD_VALUE, dtype=shard.dtype)
    view = buf[guard + offset:guard + offset + shard.numel()].view(shard.shape)
    view.copy_(shard)
    return buf, view


def _fused_tp(ops, case: Case, prob: dict) -> dict:
    """lse, logp, entropy and the full gradient from the kernels run shard by shard."""
    inv_temp, guard = 1.0 / case.temperature, -(-case.tp * case.shard // 8) * 8
    shards, stats = [], []
    for r in range(case.tp):
        buf, view = _guarded(prob["logits"][:, r * case.shard:(r + 1) * case.shard], guard,
                             case.offset)
        t_local = prob["targets"] - r * case.shard
        valid = max(0, min(case.shard, case.vocab_size - r * case.shard))
        shards.append((buf, view, t_local, valid))
        stats.append(ops.logprob_stats(view, t_local, valid, inv_temp))
    lse, logp, entropy = merge_shard_stats(torch.stack(stats))
    grads = []
    for buf, view, t_local, valid in shards:
        backward = ops.logprob_backward_ if case.inplace else ops.logprob_backward
        before = buf.clone()
        grad = backward(view, t_local, lse, entropy, prob["g_logp"], prob["g_ent"], valid,
                        inv_temp)
        inside = torch.zeros_like(buf, dtype=torch.bool)
        inside[guard + case.offset:guard + case.offset + view.numel()] = case.inplace
        assert torch.equal(buf[~inside], before[~inside]), "backward wrote outside its rows"
        grads.append(grad.clone())
    return dict(lse=lse, logp=logp, entropy=entropy, grad=torch.cat(grads, 1))


def check_against_fp64(ops, case: Case) -> None:
    """Per-token outputs within 4 fp32 ulps of |lse|, gradient within 1 storage ulp."""
    prob = _problem(case)
    got = _fused_tp(ops, case, prob)
    ref = reference64(prob["logits"], prob["targets"], case.vocab_size, case.temperature,
                      prob["g_logp"], prob["g_ent"])
    scale = ulp(ref["lse"].abs() + 1, torch.float32)   # fp32 spacing at the row's lse
    for key in ("lse", "logp", "entropy"):
        err = ((got[key].double() - ref[key]).abs() / scale).max().item()
        assert err <= 4, f"{case.name}: {key} off by {err:.1f} fp32 ulps of lse"
    # Gradient: within 1 ulp of the storage dtype at the reference (bf16, fp16). For fp32
    # storage add the error of fp32 arithmetic: exp of x / T - lse rounded to fp32 is off by a
    # few eps * |x / T - lse| relative, times the largest term of the element.
    x = prob["logits"].double() / case.temperature
    z = (x - ref["lse"][:, None]).abs()
    rounded = ref["grad"].to(case.dtype).double()
    allowed = ulp(rounded, case.dtype)
    if case.dtype == torch.float32:
        allowed = 2 * allowed + 4 * torch.finfo(torch.float32).eps * (z + x.abs() + 1) * \
            ref["grad_terms"]
    worst = ((got["grad"].double() - rounded).abs() / allowed).max().item()
    assert worst <= 1, f"{case.name}: gradient off by {worst:.2f} x the allowed error"
    padding = torch.arange(got["grad"].shape[1]) >= case.vocab_size
    assert torch.count_nonzero(got["grad"][:, padding]) == 0, f"{case.name}: padding gradient"


def check_deterministic(ops, case: Case) -> None:
    """Bit-identical results across repeats and across 1 or 2 host threads running blocks."""
    prob = _problem(case, seed=1)
    first = _fused_tp(ops, case, prob)
    saved = os.environ.get("KLEAR_EMU_THREADS")
    os.environ["KLEAR_EMU_THREADS"] = "1"    # read by the emulated launch at every launch
    try:
        second = _fused_tp(ops, case, prob)
    finally:
        if saved is None:
            del os.environ["KLEAR_EMU_THREADS"]
        else:
            os.environ["KLEAR_EMU_THREADS"] = saved
    for key in first:
        assert torch.equal(first[key], second[key]), f"{case.name}: {key} not deterministic"


# Row windows of a T=32768 x 151,936 bf16 tensor: rows 14133..14135 straddle element 2^31,
# rows 28267..28269 straddle 2^32 (row * V crosses each bound inside the middle row).
BIG_ROWS, BIG_VOCAB = 32768, 151936
WINDOWS = [(14133, 3), (28267, 3)]


def check_rows_beyond_2_31(ops) -> None:
    """Stats and gradient of rows around 2^31 / 2^32 elements equal the same rows run alone."""
    g = torch.Generator().manual_seed(5)
    for first, count in WINDOWS:
        assert first * BIG_VOCAB < 2**31 * (first // 14000) < (first + count) * BIG_VOCAB
        logits = (torch.randn(count, BIG_VOCAB, generator=g) * 3).to(torch.bfloat16)
        targets = torch.randint(0, BIG_VOCAB, (count,), generator=g)
        rows = [torch.randn(count, generator=g).abs() + 10, torch.rand(count, generator=g) * 5,
                torch.randn(count, generator=g), torch.randn(count, generator=g)]
        alone = ops.logprob_stats(logits, targets, BIG_VOCAB, 1.0)
        alone_grad = ops.logprob_backward(logits, targets, *rows, BIG_VOCAB, 1.0)
        # Pretend the buffers are rows [first, first + count) of [BIG_ROWS, BIG_VOCAB] tensors.
        shift = {"x": first * BIG_VOCAB * 2, "t": first * 8, "row": first * 4}
        stats = torch.zeros(count, 4)
        grad = torch.zeros_like(logits)
        base = lambda t, k: ctypes.c_void_p(t.data_ptr() - shift[k])  # noqa: E731
        with ops.row_window(first, first + count):
            assert ops.lib.klear_logprob_stats_cuda(
                1, base(logits, "x"), BIG_ROWS, BIG_VOCAB, base(targets, "t"), BIG_VOCAB, 1.0,
                ctypes.c_void_p(stats.data_ptr() - first * 16), None) == 0
            assert ops.lib.klear_logprob_backward_cuda(
                1, base(logits, "x"), base(grad, "x"), BIG_ROWS, BIG_VOCAB, base(targets, "t"),
                BIG_VOCAB, 1.0, *(base(r, "row") for r in rows), None) == 0
        assert torch.equal(stats, alone), f"rows {first}+: stats differ beyond 2^31 elements"
        assert torch.equal(grad, alone_grad), f"rows {first}+: gradient differs"


CHECKS = {**{f"fp64:{c.name}": (lambda ops, c=c: check_against_fp64(ops, c)) for c in CASES},
          "deterministic": lambda ops: check_deterministic(ops, CASES[1]),
          "rows-beyond-2^31": check_rows_beyond_2_31}


@pytest.mark.parametrize("name", list(CHECKS))
def test_emulated_cuda_kernels(name):
    CHECKS[name](emulated_ops())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_kernels_match_fp64_too(case):
    """The C++ CPU kernels meet the same fp64 bounds (blocked fp32/fp64 sums), so either
    backend can serve as the other's reference."""
    from megatron_klear import _C  # noqa: F401  (registers torch.ops.klear)
    check_against_fp64(torch.ops.klear, case)


COPY_CHECK = """
from tests.multiprocess.test_cuda_emu import CASES, check_against_fp64
for case in CASES:
    if case.dtype == torch.bfloat16:
        check_against_fp64(torch.ops.klear, case)
"""


def test_every_cpu_kernel_copy_matches_fp64():
    """The bf16 cases through every lower CPU kernel copy (generic AVX-512, AVX2, SSE2): this
    machine's best copy (the AVX-512 BF16 intrinsics on Zen 4) runs in the test above."""
    check_every_lower_copy(COPY_CHECK)


def test_each_planted_bug_fails_a_check():
    """Mutation test: every KLEAR_MUTATION build fails at least one of the checks above."""
    build([0, *MUTATIONS])   # compiles the variants in parallel
    missed = []
    for k, bug in MUTATIONS.items():
        ops = emulated_ops(k)
        for check in CHECKS.values():
            try:
                check(ops)
            except AssertionError:
                break   # caught
        else:
            missed.append(bug)
    assert not missed, f"planted bugs that every check missed: {missed}"

