"""The CPU GEMM choice (platform.cpu_matmul, csrc/cpu/onednn_gemm.h) against float64 matmuls.

``klear::onednn_mm`` runs a varying dimension in fixed pieces (oneDNN) and a remainder (MKL);
the cases cross every piece boundary in the rows and in the reduction, in the three layouts
megatron's linear layers produce (forward ``x @ w.t()``, input gradient ``g @ w``, weight
gradient ``g.t() @ x``) and in layouts the op must take whole.
"""

from __future__ import annotations

import pytest
import torch

from megatron_klear import platform

# rows, reduction, columns: below, at and across the 64- and 256-row pieces
SHAPES = [(1, 7, 5), (63, 128, 64), (64, 128, 256), (65, 300, 103), (255, 64, 512),
          (256, 256, 128), (257, 1000, 64), (700, 128, 512), (1000, 700, 128)]
LAYOUTS = {
    "forward": lambda a, b: (a.contiguous(), b.t().contiguous().t()),
    "input_grad": lambda a, b: (a.contiguous(), b.contiguous()),
    "weight_grad": lambda a, b: (a.t().contiguous().t(), b.contiguous()),
    "both_transposed": lambda a, b: (a.t().contiguous().t(), b.t().contiguous().t()),
    "strided_slice": lambda a, b: (torch.cat([a, a], 1)[:, :a.shape[1]], b.contiguous()),
}


def _onednn():
    op = platform._onednn_mm()
    if op is None:
        pytest.skip("this machine's torch has no oneDNN fp32 matmul (platform.cpu_matmul "
                    "falls back to torch's; test_cpu_matmul_falls_back covers that)")
    return op


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_onednn_mm_matches_float64(layout):
    op = _onednn()
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a64, b64 = torch.randn(m, k, generator=g, dtype=torch.float64), \
            torch.randn(k, n, generator=g, dtype=torch.float64)
        a, b = LAYOUTS[layout](a64.float(), b64.float())
        got = op(a, b)
        assert got.shape == (m, n) and got.is_contiguous()
        torch.testing.assert_close(got.double(), a64 @ b64, rtol=0, atol=2e-6 * k ** 0.5 * 4,
                                   msg=lambda msg: f"{layout} {m}x{k}x{n}: {msg}")


def test_onednn_mm_refuses_what_it_cannot_multiply():
    op = _onednn()
    with pytest.raises(RuntimeError, match="fp32 CPU matrices only"):
        op(torch.ones(4, 4, dtype=torch.float64), torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        op(torch.ones(4, 3), torch.ones(4, 3))
    assert torch.equal(op(torch.ones(5, 0), torch.ones(0, 2)), torch.zeros(5, 2))


def test_cpu_matmul_takes_only_big_fp32_products_outside_autograd():
    _onednn()
    a, b = torch.randn(512, 128), torch.randn(128, 256)
    torch.testing.assert_close(platform.cpu_matmul(a, b), a @ b, rtol=1e-5, atol=1e-4)
    batched = torch.randn(2, 256, 128)
    torch.testing.assert_close(platform.cpu_matmul(batched, b), batched @ b, rtol=1e-5,
                               atol=1e-4)
    assert platform.cpu_matmul(a[:8], b[:, :8]) is None  # too small to gain
    assert platform.cpu_matmul(a.double(), b.double()) is None
    assert platform.cpu_matmul(a, b.requires_grad_()) is None  # autograd would lose the graph
    with torch.no_grad():
        assert platform.cpu_matmul(a, b) is not None


def test_cpu_matmul_falls_back(monkeypatch):
    """KLEAR_CPU_GEMM=mkl keeps torch's sgemm; an unknown value is refused by name."""
    monkeypatch.setenv(platform.CPU_GEMM_ENV, "mkl")
    platform._onednn_mm.cache_clear()
    try:
        a, w = torch.randn(512, 128), torch.randn(256, 128)
        assert platform.cpu_matmul(a, w.t()) is None
        monkeypatch.setenv(platform.CPU_GEMM_ENV, "blas")
        platform._onednn_mm.cache_clear()
        with pytest.raises(ValueError, match="KLEAR_CPU_GEMM='blas'.*onednn, mkl"):
            platform.cpu_matmul(a, w.t())
    finally:
        monkeypatch.delenv(platform.CPU_GEMM_ENV)
        platform._onednn_mm.cache_clear()


def test_megatron_linear_layers_run_on_onednn():
    """Under the CPU emulation's mode, megatron's linear forward and backward (torch.matmul
    in its autograd Function) reach klear::onednn_mm, and the gradients match float64."""
    from torch.profiler import profile

    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    _onednn()
    platform.setup()
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(300, 1, 128, generator=g, dtype=torch.float64)
    w64 = torch.randn(256, 128, generator=g, dtype=torch.float64)
    dy = torch.randn(300, 1, 256, generator=g, dtype=torch.float64)
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    with profile() as prof:
        y = linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False)
        y.backward(dy.float())
    calls = [e.count for e in prof.key_averages() if e.key == "klear::onednn_mm"]
    assert calls == [3], f"klear::onednn_mm calls (forward, dgrad, wgrad): {calls}"
    x64.requires_grad_(), w64.requires_grad_()
    (x64 @ w64.t()).backward(dy)
    for got, want in ((y, x64.detach() @ w64.detach().t()), (x.grad, x64.grad),
                      (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)
