"""The embedded server's layer-by-layer Qwen3 forward against transformers' own forward.

The reference is transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` in eager
attention, run on each sequence alone and unpadded, with no cache: the forward under test
runs a left-padded batch with its KV cache, which it must grow mid-decode.
"""

from __future__ import annotations

import pytest
import torch

from megatron_klear.models.tiny import save_tiny_hf_model
from megatron_klear.rollout.engine import qwen3_decode
from megatron_klear import platform
from megatron_klear.rollout.engine.qwen3_decode import (FusedWeights, KVCache, check_supported,
                                                        forward)

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [40, 2], [8, 8, 19, 60, 11]]
DECODE_STEPS = 12


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, tmp_path_factory):
    path = save_tiny_hf_model(tmp_path_factory.mktemp(request.param), seed=3, std=0.2,
                              moe=request.param == "moe")
    return _load(path)


@torch.no_grad()
def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("path", ["kernels", "torch", "onednn"])
def test_prefill_and_decode_match_transformers(model, path, monkeypatch):
    """With the extension's kernels (fp32 CPU), with the torch path that bf16 and CUDA models
    take, and with the fused weights whose one-token steps run oneDNN's linear (fp32 CPU
    servers; here from one row on, so that these 3-row steps take it)."""
    fused, calls = None, []
    if path == "torch":
        monkeypatch.setattr(qwen3_decode, "_kernel", lambda name: None)
    if path == "onednn":
        linear = platform.onednn_linear()
        assert linear is not None, "this torch has no oneDNN linear (torch.ops.mkldnn)"
        monkeypatch.setattr(qwen3_decode, "ONEDNN_MIN_ROWS", 1)
        monkeypatch.setattr(platform, "onednn_linear",
                            lambda: lambda *a: calls.append(1) or linear(*a))
        fused = FusedWeights(model)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    valid = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model.config, valid, torch.float32, capacity=width + 1)  # one 16-block
    logits = forward(model, ids, positions, cache, all_logits=True, fused=fused)
    for row, p in enumerate(PROMPTS):
        torch.testing.assert_close(logits[row, width - len(p):], _reference_logits(model, p),
                                   rtol=0, atol=1e-5)
    assert not calls  # a prefill keeps MKL's GEMM (its shapes differ every batch)
    seqs = [list(p) for p in PROMPTS]
    last = logits[:, -1]
    for _ in range(DECODE_STEPS):
        nxt = last.argmax(-1)
        for s, tok in zip(seqs, nxt.tolist()):
            s.append(tok)
        positions = positions[:, -1:] + 1
        last = forward(model, nxt[:, None], positions, cache, fused=fused)[:, -1]
        for row, s in enumerate(seqs):
            torch.testing.assert_close(last[row], _reference_logits(model, s)[-1],
                                       rtol=0, atol=1e-5)
    if path == "onednn":  # per step: q|k|v, o, (dense) gate|up and down per layer, lm_head
        per_step = sum(4 if hasattr(layer.mlp, "gate_proj") else 2
                       for layer in model.model.layers) + 1
        assert len(calls) == DECODE_STEPS * per_step
    assert cache.length == width + DECODE_STEPS
    assert cache.capacity > 16  # it did grow


def test_select_keeps_each_row_its_own_cache(model):
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    cache = KVCache(model.config, torch.ones_like(ids), torch.float32, capacity=16)
    positions = torch.arange(ids.shape[1]).expand(2, -1)
    forward(model, ids, positions, cache)
    cache.select(torch.tensor([1, 0, 1]))
    nxt = torch.tensor([[4], [4], [4]])
    out = forward(model, nxt, positions[:1, -1:].expand(3, 1) + 1, cache)[:, -1]
    torch.testing.assert_close(out[0], _reference_logits(model, PROMPTS[0][::-1] + [4])[-1],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], _reference_logits(model, PROMPTS[0] + [4])[-1],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2], out[0], rtol=0, atol=0)


def test_sliding_window_config_is_refused(model):
    config = type(model.config)(**model.config.to_dict())
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    with pytest.raises(ValueError, match="full attention only.*SGLang"):
        check_supported(config)
    check_supported(model.config)  # the tiny Qwen3 itself is accepted
