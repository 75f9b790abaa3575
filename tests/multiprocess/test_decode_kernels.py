"""The embedded server's decode kernels (csrc/cpu/decode_cpu.h) against the torch code they
replace, on every CPU kernel copy: ``klear::rms_norm`` against torch's ``rms_norm`` (the
Qwen3RMSNorm math), ``klear::qk_norm_rope`` against it and transformers' ``apply_rotary_pos_emb``; ``klear::decode_attention``
against ``qwen3_decode.grouped_attention`` (transformers' eager attention).

Attention cases cover grouped-query ratios 1, 2 and 4, head widths on and off the kernel's 16-float
blocks, key counts with and without a partial last block, capacities that are and are not
whole blocks (the kernel may read whole blocks only inside the capacity), padded rows, and a
cache after ``select`` and growth, as the server uses it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_klear.rollout.engine.qwen3_decode import grouped_attention
from tests.cpu_kernel_copies import check_every_lower_copy
# (rows, heads, kv_heads, dim, capacity, keys)
CASES = [(5, 4, 2, 32, 48, 48), (3, 4, 2, 32, 48, 17), (4, 2, 2, 16, 20, 19),
         (2, 8, 2, 48, 33, 30), (6, 4, 1, 64, 64, 1), (3, 6, 3, 8, 7, 7)]


def _kernel():
    from megatron_klear import _C  # noqa: F401 - registers torch.ops.klear

    return torch.ops.klear.decode_attention


def check_cases() -> None:
    kernel = _kernel()
    g = torch.Generator().manual_seed(0)
    for rows, heads, kv, dim, capacity, keys in CASES:
        q = torch.randn(rows, heads, dim, generator=g)
        k_t = torch.randn(rows, kv, dim, capacity, generator=g)
        v = torch.randn(rows, kv, capacity, dim, generator=g)
        bias = torch.zeros(rows, capacity)
        bias[0, :keys // 2] = torch.finfo(torch.float32).min  # a left-padded row
        want = grouped_attention(q[:, :, None], k_t[..., :keys], v[:, :, :keys],
                                 bias[:, None, None, :keys], dim ** -0.5)[:, 0]
        got = kernel(q, k_t, v, bias, keys, dim ** -0.5)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6,
                                   msg=lambda m: f"case {rows, heads, kv, dim, capacity, keys}: {m}")


# (rows, heads, dim) of qk_norm_rope; the input is a view with a row stride > heads * dim
NORM_ROPE_CASES = [(7, 4, 32), (3, 2, 128), (5, 3, 6)]


def check_norm_rope() -> None:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    _kernel()  # registers the ops
    kernel = torch.ops.klear.qk_norm_rope
    g = torch.Generator().manual_seed(2)
    for rows, heads, dim in NORM_ROPE_CASES:
        x = torch.randn(rows, heads * dim + 5, generator=g)[:, :heads * dim] * 3
        weight = torch.rand(dim, generator=g) + 0.5
        angles = torch.rand(rows, dim // 2, generator=g) * 50
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        normed = torch.nn.functional.rms_norm(x.view(rows, 1, heads, dim), (dim,), weight,
                                              1e-6).transpose(1, 2)  # [rows, h, 1, d]
        want, _ = apply_rotary_pos_emb(normed, normed, cos[:, None], sin[:, None])
        got = kernel(x.view(rows, heads, dim), weight, cos, sin, 1e-6)
        torch.testing.assert_close(got, want[:, :, 0], rtol=0, atol=2e-6,
                                   msg=lambda m: f"case {rows, heads, dim}: {m}")
        # the whole row normed (hidden-size norms): klear::rms_norm against torch's
        w = torch.rand(heads * dim, generator=g) + 0.5
        want = torch.nn.functional.rms_norm(x, (heads * dim,), w, 1e-6)
        torch.testing.assert_close(torch.ops.klear.rms_norm(x, w, 1e-6), want, rtol=0,
                                   atol=2e-6, msg=lambda m: f"rms_norm {rows, heads * dim}: {m}")


def test_kernel_matches_the_torch_attention():
    check_cases()


def test_norm_kernels_match_transformers_math():
    check_norm_rope()
    with pytest.raises(RuntimeError, match="dim must be even"):
        torch.ops.klear.qk_norm_rope(torch.randn(2, 1, 5), torch.ones(5), torch.ones(2, 5),
                                     torch.ones(2, 5), 1e-6)


def test_kernel_refuses_what_it_cannot_read():
    kernel = _kernel()
    q, k_t = torch.randn(2, 4, 8), torch.randn(2, 2, 8, 10)
    v, bias = torch.randn(2, 2, 10, 8), torch.zeros(2, 10)
    with pytest.raises(RuntimeError, match="keys 11 do not match"):
        kernel(q, k_t, v, bias, 11, 1.0)  # more positions than the cache holds
    with pytest.raises(RuntimeError, match="fp32 CPU tensors only"):
        kernel(q.double(), k_t, v, bias, 4, 1.0)
    with pytest.raises(RuntimeError, match="unit stride"):
        kernel(q, k_t.transpose(2, 3).contiguous().transpose(2, 3), v, bias, 4, 1.0)
    with pytest.raises(RuntimeError, match="do not match"):  # key rows not capacity apart
        kernel(q, torch.randn(2, 2, 8, 12)[..., :10], v, bias, 4, 1.0)


def test_server_cache_decodes_through_the_kernel():
    """A KVCache of an fp32 CPU model attends one-token steps with the kernel, after select and
    growth, as the torch path does (the same cache through both)."""
    from types import SimpleNamespace

    from megatron_klear.rollout.engine import qwen3_decode

    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2,
                             num_attention_heads=4, hidden_size=64, head_dim=16)
    g = torch.Generator().manual_seed(1)
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = qwen3_decode.KVCache(config, valid, torch.float32, capacity=6)
    cache.append(0, torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g))
    cache.length = 5
    cache.select(torch.tensor([0, 1, 1]))
    for step in range(20):  # grows past its first 16-position block
        cache.reserve(cache.length + 1)
        cache.append(0, torch.randn(3, 2, 1, 16, generator=g),
                     torch.randn(3, 2, 1, 16, generator=g))
        q = torch.randn(3, 4, 1, 16, generator=g)
        got = cache.attend(0, q, cache.mask(1), 0.25)
        want = grouped_attention(q, cache.k[0][..., :cache.length + 1],
                                 cache.v[0][:, :, :cache.length + 1], cache.mask(1), 0.25)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        cache.length += 1
    assert cache.capacity > 16 and cache.capacity % qwen3_decode.DECODE_BLOCK == 0


def test_every_cpu_kernel_copy_matches():
    check_every_lower_copy("from tests.multiprocess.test_decode_kernels import check_cases, check_norm_rope\n"
                           "check_cases()\ncheck_norm_rope()\n", timeout_s=300)
