"""THD packing: bins, the pack layout, varlen attention vs a dense reference, packed vs
unpacked log-probs and gradients at TP=2 and PP=2, and the memory of a 32K-token pack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_klear.data.packing import build_packed_batch, pack_bins, padding_fraction, \
    run_positions, thd_pack
from tests.dist import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]


def test_pack_bins_first_fit_decreasing_by_hand():
    lengths = [5, 9, 3, 12, 7, 2, 8]  # next-token positions 4, 8, 2, 11, 6, 1, 7
    bins = pack_bins(lengths, 16)
    # by hand: 11 -> A; 8 -> B; 7 -> B(15); 6 -> C; 4 -> A(15); 2 -> C(8); 1 -> A(16)
    assert bins == [[0, 3, 5], [1, 6], [2, 4]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert pack_bins(lengths, 16, window=1) == [[i] for i in range(7)]
    assert pack_bins(lengths, 16, window=None) == bins
    # windows never mix: samples 0-2 and 3-5 are packed apart
    assert all(max(b) < 3 or min(b) >= 3 for b in pack_bins([4, 4, 4, 4, 4, 4], 16, window=3))
    with pytest.raises(ValueError, match="sample 0"):
        pack_bins([30], 16)


def test_thd_pack_layout():
    samples = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])]
    b = build_packed_batch(samples, [0, 1], multiple=4)  # 5 positions, padded to 8
    assert b["tokens"].tolist() == [[1, 2, 3, 5, 6, 0, 0, 0]]
    assert b["labels"][0, :5].tolist() == [2, 3, 4, 6, 7]
    assert b["loss_mask"][0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # restart per sequence
    assert b["segment_ids"][0].tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8] and b["max_seqlen"] == 3
    assert b["cu_seqlens"].dtype == torch.int32
    assert all(v.numel() <= 8 for v in b.values() if torch.is_tensor(v))  # nothing s x s
    with pytest.raises(ValueError, match="advantages of sequence 1"):
        thd_pack([[1, 2, 3], [4, 5]], {"advantages": [[0.0, 1.0], [0.0, 1.0]]})


def test_thd_pack_shares_prompts_by_hand():
    """Two samples of prompt [1, 2, 3] share it; a lone prompt's sample stays whole."""
    seqs = [[1, 2, 3, 10, 11], [1, 2, 3, 12], [7, 8, 9]]
    mask = [[0, 0, 1, 1], [0, 0, 1], [0, 1]]
    b = thd_pack(seqs, {"m": mask}, prompt_lens=[3, 3, 2], multiple=4)
    # prefix [1, 2] (labels 2, 3), branches [3, 10] -> (10, 11) and [3] -> (12), then [7, 8]
    assert b["tokens"].tolist() == [[1, 2, 3, 10, 3, 7, 8, 0]]
    assert b["labels"].tolist() == [[2, 3, 10, 11, 12, 8, 9, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 2, 0, 1, 0]]  # branches continue
    assert b["segment_ids"].tolist() == [[-1, -1, 0, 0, 1, 2, 2, -1]]
    assert b["m"].tolist() == [[0, 0, 1, 1, 1, 0, 1, 0]]
    assert b["cu_seqlens"].tolist() == [0, 2, 4, 5, 7, 8]
    assert b["parent_segment"].tolist() == [-1, 0, 0, -1, -1]
    assert run_positions(3, [5, 4]) + run_positions(2, [3]) == 7  # the pack's 7 positions
    assert run_positions(3, [5]) + run_positions(3, [4]) + run_positions(2, [3]) == 9
    # different prompts of the same length, or a lone sample, are not shared
    assert "parent_segment" not in thd_pack([[1, 2, 3, 4], [1, 5, 3, 4]], prompt_lens=[3, 3])
    assert "parent_segment" not in thd_pack([[1, 2, 3, 4]], prompt_lens=[3])


def test_padding_fraction_drops_with_packing():
    lengths = [10, 20, 5, 30, 12, 8] * 5
    assert padding_fraction(lengths, 64, packed=True) < padding_fraction(lengths, 64, packed=False)


@pytest.mark.parametrize("max_scores,shared", [(2**24, False), (100, False), (2**24, True)])
def test_varlen_attention_matches_dense_block_diagonal_reference(max_scores, shared, monkeypatch):
    """One group per length band / many groups / prompt sharing (segments 1 and 3 are
    branches of prefix 0, segment 5 of prefix 4: each sees its prefix, then itself)."""
    from megatron_klear.models import varlen_attention as va

    monkeypatch.setattr(va, "MAX_GROUP_SCORES", max_scores)
    g = torch.Generator().manual_seed(0)
    lens = [7, 1, 12, 5, 6, 12, 3]
    parents = [-1, 0, -1, 0, -1, 4, -1] if shared else None
    total, heads, groups, d = sum(lens), 4, 2, 8
    q = torch.randn(total, heads, d, generator=g, requires_grad=True)
    k = torch.randn(total, groups, d, generator=g, requires_grad=True)
    v = torch.randn(total, groups, d, generator=g, requires_grad=True)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    out = va.varlen_causal_attention(q, k, v, cu, scale=0.3, parents=parents)
    # reference: explicit softmax over a dense block-diagonal causal mask, heads repeated
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    for child, parent in enumerate(parents or []):
        if parent >= 0:
            allowed |= (seg[:, None] == child) & (seg[None, :] == parent)
    kk, vv = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 0.3
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), vv)
    assert (out - ref).abs().max() < 1e-5
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(grads, want)) < 1e-5
    if max_scores == 100:
        assert len(va.length_groups(lens, heads)) == len(lens)  # the budget split every group
    elif not shared:  # one group per length band: the two 12s, then 7 and 6 (padded), singles
        assert va.length_groups(lens, heads) == [[2, 5], [0, 4], [3], [6], [1]]


@pytest.mark.parametrize("interleaved", [False, True])
def test_pack_rotation_is_megatrons_bit_for_bit(interleaved):
    """VarlenCoreAttention rotates a shared-prompt pack with cosines and sines made once per
    pack; the result equals megatron's unfused apply_rotary_pos_emb at the same positions (the
    branches continuing their prompt's), bit for bit, and so do the gradients."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_klear.models import varlen_attention as va

    table = torch.rand(64, 1, 1, 16, generator=torch.Generator().manual_seed(1)) * 20  # angles
    config = SimpleNamespace(rotary_interleaved=interleaved, multi_latent_attention=False,
                             apply_rope_fusion=False)
    lens, parents = [5, 3, 4, 6, 2], [-1, 0, 0, -1, 3]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    params = va.SharedPrefixParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                   parent_segment=torch.tensor(parents))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 4, 16, generator=g, requires_grad=True)
    k = torch.randn(sum(lens), 2, 16, generator=g, requires_grad=True)
    me = SimpleNamespace(position_emb=lambda n: table[:n], config=config)
    ours = va.VarlenCoreAttention._rotate(me, q, k, params)
    again = va.VarlenCoreAttention._rotate(me, q, k, params)  # the kept cos/sin
    freqs = table[va.pack_positions(cu.tolist(), parents)]
    theirs = [apply_rotary_pos_emb(t.unsqueeze(1), freqs, config, cp_group=object()).squeeze(1)
              for t in (q, k)]
    w = [torch.randn(t.shape, generator=g) for t in theirs]
    for a, b, c, wt in zip(ours, again, theirs, w):
        assert torch.equal(a, c) and torch.equal(b, c)
    grads = torch.autograd.grad(sum((a * wt).sum() for a, wt in zip(ours, w)), (q, k))
    want = torch.autograd.grad(sum((c * wt).sum() for c, wt in zip(theirs, w)), (q, k))
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def _packed_vs_unpacked(rank, world, hf_dir):
    """Per-sequence log-probs and parameter grads of one pack vs one sequence per micro-batch
    (megatron's own causal DotProductAttention), at TP=2 and then PP=2 (variable lengths)."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine

    arch = qwen3_config_from_hf(load_hf_config(hf_dir))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist()
            for n in (7, 19, 5, 12, 30, 9)]
    weights = [torch.rand(len(s) - 1, generator=g).tolist() for s in seqs]
    pack = thd_pack(seqs, {"weight": weights}, multiple=2)
    n_labels = sum(len(s) - 1 for s in seqs)
    alone = []
    for s, w in zip(seqs, weights):
        mb = thd_pack([s], {"weight": [w]})
        del mb["cu_seqlens"], mb["max_seqlen"]  # a plain causal batch
        alone.append(mb)
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        initialize_parallel(tp, pp, seed=0)
        cfg = TrainConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        engine = build_engine(cfg, arch, with_optimizer=False)
        load_hf_weights(engine.model, arch, SafetensorsReader(hf_dir))

        def run(mbs, keep_cu=True):
            seen = []

            def loss_fn(logits, b):
                logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), b["labels"])
                seen.append((logp.detach()[0], b["segment_ids"][0]))
                return -(logp * b["weight"]).sum() / n_labels, {}  # token mean, as training

            if not keep_cu:
                mbs = [{k: v for k, v in mb.items() if k not in ("cu_seqlens", "max_seqlen")}
                       for mb in mbs]
            for p in engine.model[0].parameters():
                p.grad = None
            engine.forward_backward(mbs, loss_fn)
            grads = {n: p.grad.clone() for n, p in engine.model[0].named_parameters()}
            if not seen:
                return None, grads
            per_seq = [lp[seg == i] for lp, seg in seen for i in range(int(seg.max()) + 1)]
            return per_seq, grads

        lp_pack, g_pack = run([pack])
        lp_alone, g_alone = run(alone)
        lp_leak, _ = run([pack], keep_cu=False)  # negative control: one causal sequence
        res = {"grad_diff": max(float((g_pack[n] - g_alone[n]).abs().max()) for n in g_pack),
               "grad_max": max(float(g.abs().max()) for g in g_alone.values())}
        if lp_pack is not None:
            res["lp_diff"] = max(float((a - b).abs().max()) for a, b in zip(lp_pack, lp_alone))
            res["leak_diff"] = max(float((a - b).abs().max()) for a, b in zip(lp_leak, lp_alone))
            res["n_seq"] = len(lp_pack)
        out[f"tp{tp}pp{pp}"] = res
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(tmp_path_factory.mktemp("pack") / "hf", seed=0, std=0.2)


def test_packed_and_unpacked_logprobs_and_grads_match_tp2_pp2(hf_model):
    results = run_distributed(_packed_vs_unpacked, 2, str(hf_model))
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["grad_max"] > 1e-3, (rank, layout, r)  # real gradients
            assert r["grad_diff"] < 1e-5, (rank, layout, r)
            if "lp_diff" in r:  # ranks holding the logits (every TP rank, the last PP stage)
                assert r["n_seq"] == 6
                assert r["lp_diff"] < 1e-5, (rank, layout, r)
                assert r["leak_diff"] > 1e-2, (rank, layout, r)  # attention across would show
    assert "lp_diff" in results[1]["tp1pp2"] and "lp_diff" not in results[0]["tp1pp2"]


_MEMORY_PROBE = r"""
import json, sys, torch
from megatron_klear.data.packing import thd_pack
from megatron_klear.config import TrainConfig
from megatron_klear.models.qwen3 import qwen3_config_from_hf
from megatron_klear.models.tiny import tiny_qwen3_config
from megatron_klear.distributed import initialize_parallel
from megatron_klear.train.engine import build_engine

total, seq = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
initialize_parallel(1, 1, seed=0)
arch = qwen3_config_from_hf(tiny_qwen3_config(
    vocab_size=64, max_position_embeddings=total, hidden_size=32, intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16))
model = build_engine(TrainConfig(), arch, with_optimizer=False).model[0]
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 64, (seq + 1,), generator=g).tolist() for _ in range(total // seq)]
pack = thd_pack(seqs)
from megatron_klear.train.engine import packed_seq_params
from tests.peak_memory import peak_allocated_bytes


def step():
    logits = model(pack["tokens"], pack["position_ids"], None,
                   packed_seq_params=packed_seq_params(pack))
    logits.float().logsumexp(-1).sum().backward()


print(json.dumps({"tokens": int(pack["tokens"].numel()),
                  "peak_growth_mib": peak_allocated_bytes(step) / 2**20}))
"""


def test_32k_token_pack_builds_no_s_by_s_tensor():
    """Forward + backward of one 32,768-token pack (32 sequences of 1,024) on CPU: the peak of
    live tensor bytes (tests/peak_memory.py) grows by far less than one s x s tensor would take (a bool 32K x 32K mask alone is
    1 GiB, fp32 scores 4 GiB per head), and 4x the tokens of an 8K pack cost ~4x, not 16x."""
    growth = {}
    for total in (8192, 32768):
        proc = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(total), "1024"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=dict(os.environ, MASTER_PORT=str(free_port())))
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["tokens"] == total
        growth[total] = r["peak_growth_mib"]
    assert growth[32768] < 512, growth  # a 32K x 32K bool mask alone is 1024 MiB
    assert growth[32768] < 6 * growth[8192], growth  # linear in the pack length
