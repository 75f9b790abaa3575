"""Packing: per-sample losses of packed and unpacked batches agree; bins keep order."""

import pytest
import torch

from megatron_klear.data.packing import build_packed_batch, pack_bins, padding_fraction
from tests.dist import run_distributed

VOCAB = 103


def test_pack_bins_first_fit_decreasing_by_hand():
    lengths = [5, 9, 3, 12, 7, 2, 8]  # next-token positions 4, 8, 2, 11, 6, 1, 7
    bins = pack_bins(lengths, 16)
    # by hand: 11 -> A; 8 -> B; 7 -> B(15); 6 -> C; 4 -> A(15); 2 -> C(8); 1 -> A(16)
    assert bins == [[0, 3, 5], [1, 6], [2, 4]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert pack_bins(lengths, 16, window=1) == [[i] for i in range(7)]
    # windows never mix: samples 0-2 and 3-5 are packed apart
    assert all(max(b) < 3 or min(b) >= 3 for b in pack_bins([4, 4, 4, 4, 4, 4], 16, window=3))
    with pytest.raises(ValueError, match="sample 0"):
        pack_bins([30], 16)


def test_mask_is_block_diagonal_causal():
    samples = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7], [0, 1, 1])]
    b = build_packed_batch(samples, [[0, 1]], seq_length=6)
    m = b["attention_mask"][0, 0]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0]
    assert b["labels"][0, :5].tolist() == [2, 3, 4, 6, 7]
    assert b["loss_mask"][0].tolist() == [0, 1, 1, 1, 1, 0]
    assert not m[4, 3] and m[3, 2] and m[1, 2] and not m[2, 0]  # True = masked


def test_padding_fraction_drops_with_packing():
    lengths = [10, 20, 5, 30, 12, 8] * 5
    assert padding_fraction(lengths, 64, packed=True) < padding_fraction(lengths, 64, packed=False)


def _per_sample_losses(rank, world):
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.token_loss import token_nll

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB))
    model = build_engine(TrainConfig(), arch, with_optimizer=False).model[0].eval()
    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (7, 12, 5, 9, 15):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        samples.append((ids, [0] * 2 + [1] * (n - 2)))

    def losses(bins, seq):
        b = build_packed_batch(samples, bins, seq)
        with torch.no_grad():
            logits = model(b["tokens"], b["position_ids"], b["attention_mask"])
        nll = token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]
        out = {}
        for row, members in enumerate(bins):
            for seg, idx in enumerate(members):
                out[idx] = float(nll[row][b["segment_ids"][row] == seg].sum())
        return out

    packed = losses(pack_bins([len(s[0]) for s in samples], 24), 24)
    alone = losses([[i] for i in range(len(samples))], 24)
    return packed, alone


def test_packed_and_unpacked_losses_match():
    packed, alone = run_distributed(_per_sample_losses, 1)[0]
    assert sorted(packed) == sorted(alone) == list(range(5))
    for i in alone:
        assert abs(packed[i] - alone[i]) < 1e-5, (i, packed[i], alone[i])
    assert len(set(round(v, 3) for v in alone.values())) == 5  # real, distinct losses
