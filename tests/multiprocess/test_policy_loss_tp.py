"""Fused policy-loss op at TP=2 (2 gloo ranks, vocabulary split across ranks).

Each rank builds the same full-vocabulary problem, runs the op on its shard with the TP group,
and compares against the torch reference at TP=1 on the full logits (computed in the same
process): loss, logprobs, entropy, metrics and the gradient slice of its shard; and the
hand-computed loss tables (tests/policy_loss_cases.hand_table: GPPO with CE-GPPO's betas, PPO,
CISPO, dual clip, ERC) on 3 + 3 vocabulary columns. All cases run in one launch (process
start-up dominates on 2 cores).
"""

import torch
import torch.distributed as dist

from tests.dist import run_distributed
from tests.policy_loss_cases import (HAND_SETTINGS, assert_match, hand_table, make_inputs,
                                     run_hand_table, run_op)

VOCAB = 2 * 131   # V/TP = 131
# (name, vocab_size, dtype, kwargs): padding inside rank 1's shard; rank 1 ALL padding.
CASES = [("fp32", None, torch.float32, dict(loss_type="gppo", dual_clip=3.0)),
         ("fp32-temp-padded", 250, torch.float32, dict(loss_type="ppo", temperature=0.7)),
         ("fp32-rank1-all-padding", 120, torch.float32, dict(loss_type="gppo")),
         ("fp32-cispo-empty-mask", None, torch.float32, dict(loss_type="cispo", empty=True)),
         ("fp32-ppo-erc", 250, torch.float32, dict(loss_type="ppo", dual_clip=3.0,
                                                   entropy_ratio_clip=0.1)),
         ("bf16-gppo-erc", None, torch.bfloat16, dict(loss_type="gppo", beta1=0.75,
                                                      entropy_ratio_clip=0.1)),
         ("bf16", 250, torch.bfloat16, dict(loss_type="gppo", temperature=1.5))]


def _check_tp2(rank: int, world_size: int, backends: list[str]) -> list[str]:
    group = dist.new_group([0, 1])
    local = VOCAB // world_size
    checked = []
    for name, vocab_size, dtype, kw in CASES:
        kw = dict(kw)
        inp = make_inputs(40, VOCAB, vocab_size=vocab_size, seed=7,
                          empty_mask=kw.pop("empty", False))
        logits = inp["logits"].to(dtype)
        owners = (inp["targets"] // local).unique().tolist()
        assert vocab_size == 120 or owners == [0, 1], "targets must fall in both shards"
        ref = run_op(inp, logits, backend="torch", vocab_size=vocab_size, **kw)
        ref["grad"] = ref["grad"][:, rank * local:(rank + 1) * local]
        shard = logits[:, rank * local:(rank + 1) * local]
        for backend in backends:
            got = run_op(inp, shard, backend=backend, tp_group=group, vocab_size=vocab_size, **kw)
            assert_match(got, ref, dtype, f"rank {rank} {backend} {name}")
            checked.append(f"{backend}:{name}")
    for setting in HAND_SETTINGS:
        table = hand_table(*setting)
        half = table["logits"].shape[1] // world_size
        for backend in backends:
            shard = table["logits"][:, rank * half:(rank + 1) * half]
            loss, grad, _ = run_hand_table(table, shard, backend=backend, tp_group=group)
            what = f"rank {rank} {backend} hand table {setting}"
            assert abs(loss.item() - table["loss"]) < 1e-6, what
            torch.testing.assert_close(grad, table["grad"][:, rank * half:(rank + 1) * half],
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
            checked.append(f"{backend}:hand:{setting}")
    return checked


def test_tp2_matches_tp1_reference_and_hand_tables():
    results = run_distributed(_check_tp2, 2, ["torch", "cpu", "cuda-emu"])
    assert results[0] == results[1]
    assert len(results[0]) == 3 * (len(CASES) + len(HAND_SETTINGS))
