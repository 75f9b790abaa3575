"""The HF <-> Megatron mapping's TP split/merge against hand-built layouts (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron_klear.checkpoint import hf_bridge
from megatron_klear.models.qwen3 import qwen3_config_from_hf
from megatron_klear.models.tiny import tiny_qwen3_config

ARCH = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=103))  # 4 heads, 2 groups, head_dim 16


def _rows(n: int, offset: float, cols: int = 64) -> torch.Tensor:
    """A [n, cols] tensor whose row r holds offset + r everywhere (rows are identifiable)."""
    return (offset + torch.arange(n, dtype=torch.float32))[:, None].expand(n, cols).clone()


def test_qkv_shard_holds_its_query_groups_in_megatron_order():
    q, k, v = _rows(64, 0), _rows(32, 1000), _rows(32, 2000)
    shard = hf_bridge.split_for_rank("qkv", [q, k, v], ARCH, tp=2, rank=1)
    # TP rank 1 owns query group 1: its 2 query heads (q rows 32..63), then k/v rows 16..31.
    expected = torch.cat([q[32:64], k[16:32], v[16:32]])
    assert torch.equal(shard, expected)


def test_gate_up_shard_is_gate_half_then_up_half():
    gate, up = _rows(128, 0), _rows(128, 1000)
    shard = hf_bridge.split_for_rank("gate_up", [gate, up], ARCH, tp=2, rank=0)
    assert torch.equal(shard, torch.cat([gate[:64], up[:64]]))


def test_vocab_shard_is_zero_padded_to_megatrons_size():
    emb = _rows(103, 1)
    shards = [hf_bridge.split_for_rank("vocab", [emb], ARCH, tp=2, rank=r) for r in range(2)]
    assert [s.shape[0] for s in shards] == [128, 128]  # 103 -> 256 = 128 x TP
    assert torch.equal(shards[0][:103], emb) and not shards[0][103:].any() and not shards[1].any()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind,shapes", [
    ("qkv", [(64, 64), (32, 64), (32, 64)]), ("gate_up", [(128, 64), (128, 64)]),
    ("vocab", [(103, 64)]), ("row", [(64, 128)]),
    ("replicated", [(16,)]),
])
def test_split_then_merge_is_identity(kind, shapes, tp):
    full = [torch.randn(s) for s in shapes]
    shards = [hf_bridge.split_for_rank(kind, full, ARCH, tp, r) for r in range(tp)]
    merged = hf_bridge.merge_shards(kind, shards, ARCH)
    assert len(merged) == len(full) and all(torch.equal(a, b) for a, b in zip(merged, full))


def test_hf_names_follow_the_tying_convention():
    tied = qwen3_config_from_hf(tiny_qwen3_config(tie_word_embeddings=True))
    assert "lm_head.weight" in hf_bridge.hf_tensor_names(ARCH)
    assert "lm_head.weight" not in hf_bridge.hf_tensor_names(tied)
    assert len(hf_bridge.hf_tensor_names(ARCH)) == 3 + 11 * ARCH.num_layers


@pytest.mark.parametrize("names,match", [
    (lambda n: n[1:], "missing tensor"),
    (lambda n: n + ["model.layers.0.mlp.extra.weight"], "unexpected tensor 'model.layers.0.mlp"),
    (lambda n: n + ["model.layers.2.input_layernorm.weight"], "model.layers.2.input_layernorm"),
])
def test_name_check_names_the_offending_tensor(names, match):
    with pytest.raises(hf_bridge.BridgeError, match=match):
        hf_bridge.check_hf_names(names(hf_bridge.hf_tensor_names(ARCH)), ARCH)


def test_shape_check_names_the_tensor():
    with pytest.raises(hf_bridge.BridgeError, match="'model.layers.1.mlp.up_proj.weight'"):
        hf_bridge.check_hf_shape("model.layers.1.mlp.up_proj.weight", (100, 64), ARCH)
