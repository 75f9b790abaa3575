"""ops.rms_norm (klear::rms_norm / klear::rms_norm_backward, csrc/cpu/rms_norm_cpu.h) against
torch's F.rms_norm in float64, forward and both gradients, on every CPU kernel copy."""

from __future__ import annotations

import pytest
import torch

from megatron_klear.ops import vocab_parallel
from megatron_klear.ops.rms_norm import rms_norm
from tests.cpu_kernel_copies import check_every_lower_copy

# input shapes: megatron's hidden states [s, b, h] and the q/k head norms [s, b, heads, d]
SHAPES = [(7, 1, 128), (33, 2, 4, 32), (5, 1, 2, 6), (1, 1, 1)]


def check_against_torch() -> None:
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        x64 = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
        w64 = (torch.rand(shape[-1], generator=g, dtype=torch.float64) + 0.5).requires_grad_()
        dy = torch.randn(*shape, generator=g, dtype=torch.float64)
        want = torch.nn.functional.rms_norm(x64, w64.shape, w64, 1e-6)
        want.backward(dy)
        x, w = x64.detach().float().requires_grad_(), w64.detach().float().requires_grad_()
        got = rms_norm(x, w, 1e-6)
        got.backward(dy.float())
        for name, a, b in (("y", got, want), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad)):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{shape} {name}: {m}")


def test_fused_rms_norm_matches_torch():
    if vocab_parallel._extension_ops() is None:
        pytest.fail("the C++ extension is not built (python setup.py build_ext --inplace)")
    check_against_torch()


def test_fused_rms_norm_runs_its_kernels():
    from torch.profiler import profile

    x = torch.randn(16, 1, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    with profile() as prof:
        rms_norm(x, w, 1e-6).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert {"klear::rms_norm", "klear::rms_norm_backward"} <= names, sorted(names)


def test_non_fp32_and_strided_inputs_run_torchs_norm():
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (8,), w, 1e-6))
    xs = torch.randn(8, 4).t()  # unit stride along rows, not along the normalised dimension
    ws = torch.rand(8)
    assert torch.equal(rms_norm(xs, ws, 1e-6), torch.nn.functional.rms_norm(xs, (8,), ws, 1e-6))


def test_every_lower_cpu_kernel_copy():
    check_every_lower_copy("from tests.multiprocess.test_rms_norm_op import check_against_torch\n"
                           "check_against_torch()\n")
