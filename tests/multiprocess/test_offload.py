"""Trainer offload (colocated mode, issue 31): training with the trainer's parameters,
gradients and optimizer state offloaded to host memory and back between steps is bitwise
equal to training without offload (the reference: the same engine, same start, no offload),
and the offloaded storages really hold no bytes.

Runs in the strict virtual-CUDA mode (tests/virtual_cuda.py, issue 30): the trainer's tensors
report ``cuda`` and pinned host memory is emulated, so the offload takes its GPU path (device
storages only, into pinned buffers). With ``--optimizer-cpu-offload`` megatron's hybrid
optimizer keeps the optimizer state on the host already (``offloaded_copies``); the trainer
offload then moves the rest and leaves that state where it is.
"""

from __future__ import annotations

import torch

from tests.multiprocess.test_engine import VOCAB, _make_batches
from tests.virtual_cuda import offloaded_copies, run_strict

STEPS = 3


def _state(eng) -> list[torch.Tensor]:
    from megatron_klear.train.offload import trainer_tensors

    return [t.detach().cpu().clone() for t in trainer_tensors(eng.model, eng.optimizer)]


def _case(rank: int, world: int, cpu_offload: bool) -> dict:
    """The same start trained with and without trainer offload between steps."""
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.offload import TrainerOffload
    from megatron_klear.train.sft_objective import token_nll

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB))
    cfg = TrainConfig(lr=3e-3, global_batch_size=8, micro_batch_size=2, train_iters=STEPS,
                      seed=11, bf16=True, use_distributed_optimizer=True,
                      optimizer_cpu_offload=cpu_offload)
    batches, total = _make_batches(rank, world)  # TP = PP = 1: the DP rank is the rank
    batches = [{k: v.cuda() for k, v in b.items()} for b in batches]

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return nll, {"loss": nll.detach()}

    start, out = None, {}
    for offload in (True, False):
        eng = build_engine(cfg, arch)
        if start is None:
            start = {n: p.detach().clone() for n, p in eng.model[0].named_parameters()}
        with torch.no_grad():
            for n, p in eng.model[0].named_parameters():
                p.copy_(start[n])
        eng.optimizer.reload_model_params()
        mover = TrainerOffload(eng.model, eng.optimizer) if offload else None
        losses, left = [], []
        for _ in range(STEPS):
            losses.append(eng.train_step(batches, loss_fn)["loss"])
            if mover is not None:  # as a colocated step: optimizer state first, then params
                mover.offload("state")
                mover.offload("params")
                left.append(sum(s.nbytes() for g in mover.storages.values() for s in g))
                out["pinned"] = all(h.is_pinned() for hs in mover._host.values() for h in hs)
                mover.onload()
        out["offload" if offload else "plain"] = {"losses": losses, "state": _state(eng)}
        if mover is not None:
            out["moved"], out["left"] = mover.nbytes, left
            out["n_storages"] = {g: len(s) for g, s in mover.storages.items()}
            out["host_state"] = len(offloaded_copies(eng.optimizer))
    a, b = out["offload"].pop("state"), out["plain"].pop("state")  # compared here: tensors
    out["same_state"] = len(a) == len(b) and all(  # do not cross the result queue
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
    out["n_tensors"] = len(a)
    return out


def _run(rank: int, world: int) -> dict:
    return {"device_optimizer": _case(rank, world, False),
            "cpu_optimizer": _case(rank, world, True)}


def test_training_with_offload_is_bitwise_equal():
    """DP=2, distributed optimizer, bf16 (the recipes' layout), with the optimizer on the
    device and with --optimizer-cpu-offload."""
    for ranks in run_strict(_run, 2, timeout=400):
        for name, r in ranks.items():
            assert r["offload"]["losses"] == r["plain"]["losses"], name
            assert r["plain"]["losses"][-1] < r["plain"]["losses"][0], name  # it trains
            assert r["same_state"] and r["n_tensors"] > 0, name
            assert r["left"] == [0] * STEPS and r["pinned"], name  # nothing left on the device
            assert r["moved"] > 0 and r["n_storages"]["params"] == 1, name  # DDP's param_data
        # on the device: bf16 param_data, fp32 grad_data, fp32 main shards, Adam's 2 moments
        assert ranks["device_optimizer"]["n_storages"]["state"] >= 4
        assert ranks["device_optimizer"]["host_state"] == 0
        # hybrid optimizer: its state and masters stay on the host, not moved again
        assert ranks["cpu_optimizer"]["host_state"] > 0
        assert ranks["cpu_optimizer"]["moved"] < ranks["device_optimizer"]["moved"]


def _lazy_state(rank: int, world: int) -> dict:
    """An optimizer whose state appears inside ``step()`` (as Transformer Engine's FusedAdam,
    megatron's pick when TE is installed: its Adam moments are made at the first step): the
    megatron optimizer's inner torch Adam with its state dropped before the trainer offload
    is made, so that ``step()`` creates it again lazily. After a step, offload must move
    every state tensor, however late it was made."""
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.offload import TrainerOffload
    from megatron_klear.train.sft_objective import token_nll

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB))
    cfg = TrainConfig(lr=3e-3, global_batch_size=4, micro_batch_size=2, train_iters=2,
                      seed=11, bf16=True, use_distributed_optimizer=True)
    batches, total = _make_batches(rank, world)
    batches = [{k: v.cuda() for k, v in b.items()} for b in batches]

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return nll, {"loss": nll.detach()}

    eng = build_engine(cfg, arch)
    inner = eng.optimizer.optimizer
    inner.state.clear()  # no state before the first step, as FusedAdam's
    mover = TrainerOffload(eng.model, eng.optimizer)  # made before step 1, as Colocation is
    eng.train_step(batches, loss_fn)
    moments = [v for st in inner.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq")]
    before = torch.cuda.memory_allocated()
    moment_bytes = sum(m.untyped_storage().nbytes() for m in moments)
    mover.offload()
    out = {"moments": len(moments), "moment_bytes": moment_bytes,
           "left": sum(m.untyped_storage().nbytes() for m in moments),
           "freed": before - torch.cuda.memory_allocated(), "moved": mover.nbytes}
    mover.onload()
    out["back"] = sum(m.untyped_storage().nbytes() for m in moments)
    return out


def test_offload_follows_state_made_inside_step():
    """Defect 3 of issue 38: the Adam moments made inside step() leave the (virtual) GPU with
    the rest, and the virtual GPU's byte count drops by all that was moved."""
    (r,) = run_strict(_lazy_state, 1, timeout=300)
    assert r["moments"] > 0 and r["moment_bytes"] > 0
    assert r["left"] == 0 and r["back"] == r["moment_bytes"]
    # the count drops by what moved (and, at times, by a scalar temporary freed meanwhile)
    assert r["moved"] <= r["freed"] <= r["moved"] + 64 and r["moved"] >= r["moment_bytes"]
