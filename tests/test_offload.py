"""Trainer offload (colocated mode, issue 31): training with the trainer's parameters,
gradients and optimizer state offloaded to host memory and back between steps is bitwise
equal to training without offload (the reference: the same engine, same start, no offload),
and the offloaded storages really hold no bytes."""

from __future__ import annotations

import torch

from tests.dist import run_distributed
from tests.test_engine import VOCAB, _make_batches

STEPS = 3


def _state(eng) -> list[torch.Tensor]:
    from megatron_klear.train.offload import trainer_tensors

    return [t.detach().clone() for t in trainer_tensors(eng.model, eng.optimizer)]


def _run(rank: int, world: int) -> dict:
    """DP=2 with the distributed optimizer in bf16 (fp32 main shards, as the recipes): the
    same start trained with and without offload between steps."""

    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.offload import TrainerOffload
    from megatron_klear.train.token_loss import token_nll

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB))
    cfg = TrainConfig(lr=3e-3, global_batch_size=8, micro_batch_size=2, train_iters=STEPS,
                      seed=11, bf16=True, use_distributed_optimizer=True)
    batches, total = _make_batches(rank, world)  # TP = PP = 1: the DP rank is the rank

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return nll, {"loss": nll.detach()}

    start = None
    out = {}
    for offload in (True, False):
        eng = build_engine(cfg, arch)
        if start is None:
            start = {n: p.detach().clone() for n, p in eng.model[0].named_parameters()}
        with torch.no_grad():
            for n, p in eng.model[0].named_parameters():
                p.copy_(start[n])
        eng.optimizer.reload_model_params()
        mover = TrainerOffload(eng.model, eng.optimizer) if offload else None
        losses, freed = [], []
        for _ in range(STEPS):
            losses.append(eng.train_step(batches, loss_fn)["loss"])
            if mover is not None:  # as a colocated step: optimizer state first, then params
                mover.offload("state")
                mover.offload("params")
                freed.append(sum(s.nbytes() for g in mover.storages.values() for s in g))
                mover.onload()
        out["offload" if offload else "plain"] = {"losses": losses, "state": _state(eng)}
        if mover is not None:
            out["moved"], out["freed"] = mover.nbytes, freed
            out["n_storages"] = {g: len(s) for g, s in mover.storages.items()}
    a, b = out["offload"].pop("state"), out["plain"].pop("state")  # compared here: tensors
    out["same_state"] = len(a) == len(b) and all(  # do not cross the result queue
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    out["n_tensors"] = len(a)
    return out


def test_training_with_offload_is_bitwise_equal():
    for r in run_distributed(_run, 2, timeout=240):
        assert r["offload"]["losses"] == r["plain"]["losses"]
        assert r["plain"]["losses"][-1] < r["plain"]["losses"][0]  # it trains
        assert r["same_state"] and r["n_tensors"] > 0
        assert r["freed"] == [0] * STEPS  # nothing left on the device while offloaded
        # bf16 params + fp32 grads (DDP buffers), fp32 main shards + 2 Adam moments
        assert r["moved"] > 0 and r["n_storages"]["params"] == 1  # DDP's param_data
        assert r["n_storages"]["state"] >= 3
