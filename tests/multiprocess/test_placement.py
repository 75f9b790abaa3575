"""Device placement on a GPU machine, checked on CPU with the strict virtual-CUDA platform mode.

With ``KLEAR_STRICT_DEVICES=1`` the platform tags every tensor that would live on the GPU and
raises :class:`~megatron_klear.virtual_cuda.DeviceMismatchError` where CUDA torch would refuse an
op (CUDA and CPU tensors mixed, a collective on a CPU tensor). One launch at TP2 with sequence
parallel, full recompute and the distributed optimizer runs an SFT step, the RL old-log-prob
pass and an RL step, a checkpoint save and an HF export; then two planted misplacements (a
micro-batch left on the CPU, a model built on the CPU as ``use_cpu_initialization=True`` did)
must each be caught; last, a Qwen3-MoE at EP2 (router, token dispatcher, experts) runs the
SFT step, old-log-prob pass, RL step and export.

The loss runs with ``--loss-backend torch``: in this mode the logits report device cuda, and
the C++ kernel is the CPU backend (its CUDA twin is checked by tests/gpu/).
"""

from __future__ import annotations

import pytest
import torch

from megatron_klear.virtual_cuda import STRICT_ENV
from tests.dist import run_distributed

VOCAB = 103
SEQ = 16
FLAGS = dict(tensor_model_parallel_size=2, sequence_parallel=True, recompute_granularity="full",
             recompute_method="uniform", recompute_num_layers=1, use_distributed_optimizer=True,
             overlap_grad_reduce=True, overlap_param_gather=True, loss_backend="torch",
             global_batch_size=2, micro_batch_size=1, seq_length=SEQ, seed=3)


def _microbatches() -> list[dict]:
    """Two CPU micro-batches carrying SFT and RL loss inputs (as the trainers build them)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        mask = (torch.rand(1, SEQ, generator=g) > 0.3).float()
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask,
                        position_ids=torch.arange(SEQ)[None],
                        advantages=torch.randn(1, SEQ, generator=g) * mask,
                        positive=mask, rollout_logprobs=-torch.rand(1, SEQ, generator=g)))
    return out


def _engine(**changes):
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig

    cfg = RLConfig(**{**FLAGS, **changes})
    initialize_parallel(2, 1, cfg.seed)
    return build_engine(cfg, qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB)))


def _caught(step) -> str | None:
    from megatron_klear.virtual_cuda import DeviceMismatchError

    try:
        step()
    except DeviceMismatchError as exc:
        return str(exc)
    return None


def _gpu_path(rank, world, tmp):
    from megatron_klear import platform
    from megatron_klear.models import qwen3
    from megatron_klear.train import engine as engine_mod
    from megatron_klear.algo.rl_objective import PolicyLossFlags, old_logprobs, policy_loss_fn
    from megatron_klear.train.sft import sft_loss_fn

    assert platform.device().type == "cuda"
    eng = _engine(save=f"{tmp}/ckpt")
    on_cuda = all(p.device.type == "cuda" for p in eng.model[0].parameters())
    mbs = _microbatches()
    total = float(sum(mb["loss_mask"].sum() for mb in mbs))
    sft = eng.train_step(mbs, sft_loss_fn(VOCAB, total, "torch"))
    old_logprobs(eng, mbs, VOCAB, 1.0)
    rl = eng.train_step(mbs, policy_loss_fn(eng.cfg.part(PolicyLossFlags), VOCAB, total, total,
                                            backend=eng.cfg.loss_backend))
    eng.save(2, {})
    eng.export_hf(f"{tmp}/hf")
    result = {"params_on_cuda": on_cuda, "sft_loss": sft["loss"], "rl_loss": rl["train/loss"],
              "padded_sp": _padded_sp_step(eng)}

    # planted misplacement 1: the engine forgets to move the micro-batch to the device
    to_device = engine_mod.to_device
    engine_mod.to_device = lambda batch: batch
    try:
        result["batch_left_on_cpu"] = _caught(
            lambda: eng.train_step(_microbatches(), sft_loss_fn(VOCAB, total, "torch")))
    finally:
        engine_mod.to_device = to_device
    # planted misplacement 2: the model built on the CPU (the old use_cpu_initialization=True)
    # next to megatron's CUDA grad buffers; without the distributed optimizer, whose CUDA param
    # buffer would take the parameters over (on a GPU too)
    features = qwen3.model_features
    qwen3.model_features = lambda cfg: {**features(cfg), "use_cpu_initialization": True}
    try:
        cpu_model = _engine(use_distributed_optimizer=False, overlap_param_gather=False)
    finally:
        qwen3.model_features = features
    result["model_on_cpu"] = _caught(
        lambda: cpu_model.train_step(_microbatches(), sft_loss_fn(VOCAB, total, "torch")))
    result["moe_ep2"] = _moe_ep2_path(tmp)
    return result


def _padded_sp_step(eng) -> dict:
    """An RL step on padded micro-batches (--no-pack-sequences) whose longest sample has 12
    tokens: 11 next-token positions, which megatron's sequence-parallel scatter cannot split
    over TP 2 unless the length is rounded up (issue 30, defect 7)."""
    from dataclasses import replace

    from megatron_klear.data.microbatches import rollout_microbatches
    from megatron_klear.train.rl import train_on_batch
    from megatron_klear.samples import RolloutBatch
    from tests.virtual_cuda import caught

    batch = RolloutBatch(group_size=2, prompt_ids=[[5, 6, 7]] * 2 + [[8, 9]] * 2,
                         response_ids=[[10] * 4, [11] * 9, [12] * 3, [13] * 6],
                         rewards=[1.0, 0.0, 0.0, 1.0], truncated=[False] * 4,
                         prompt_index=[0, 0, 1, 1], advantages=[1.0, -1.0, -1.0, 1.0])
    batch.rollout_logprobs = [[-0.5] * len(r) for r in batch.response_ids]
    cfg = replace(eng.cfg, pack_sequences=False)
    length = rollout_microbatches(batch, range(len(batch)), cfg.micro_batch_layout(),
                                  0)[0]["tokens"].shape[1]
    return {"length": length, "error": caught(lambda: train_on_batch(eng, cfg, batch, 0))}


def _moe_ep2_path(tmp: str) -> dict:
    """Qwen3-MoE at EP2 (megatron's token dispatcher, router and experts): SFT step, RL
    old-log-prob pass, RL step and HF export, all on the virtual CUDA device."""
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_moe_config
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.algo.rl_objective import PolicyLossFlags, old_logprobs, policy_loss_fn
    from megatron_klear.train.sft import sft_loss_fn

    cfg = RLConfig(**{**FLAGS, "tensor_model_parallel_size": 1, "sequence_parallel": False,
                      "expert_model_parallel_size": 2, "save": f"{tmp}/moe"})
    initialize_parallel(1, 1, cfg.seed, ep=2)
    eng = build_engine(cfg, qwen3_config_from_hf(tiny_qwen3_moe_config(vocab_size=VOCAB)))
    mbs = _microbatches()
    total = float(sum(mb["loss_mask"].sum() for mb in mbs))
    sft = eng.train_step(mbs, sft_loss_fn(VOCAB, total, "torch"))
    old_logprobs(eng, mbs, VOCAB, 1.0)
    rl = eng.train_step(mbs, policy_loss_fn(eng.cfg.part(PolicyLossFlags), VOCAB, total, total,
                                            backend=eng.cfg.loss_backend))
    eng.export_hf(f"{tmp}/moe_hf")
    return {"sft_loss": sft["loss"], "rl_loss": rl["train/loss"]}


@pytest.fixture(scope="module")
def strict_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement")
    mp = pytest.MonkeyPatch()
    mp.setenv(STRICT_ENV, "1")  # the spawned ranks inherit it
    try:
        return tmp, run_distributed(_gpu_path, 2, str(tmp))
    finally:
        mp.undo()


def test_every_tensor_of_the_gpu_path_is_where_cuda_needs_it(strict_run):
    tmp, results = strict_run
    for r in results:
        assert r["params_on_cuda"]
        assert torch.isfinite(torch.tensor([r["sft_loss"], r["rl_loss"]])).all()
    assert (tmp / "hf" / "config.json").is_file()
    assert any((tmp / "ckpt").glob("iter_0000002/klear_meta.json"))


@pytest.mark.parametrize("plant", ["batch_left_on_cpu", "model_on_cpu"])
def test_planted_misplacement_is_caught(strict_run, plant):
    for r in strict_run[1]:
        assert r[plant] is not None and "mixes CUDA tensors with CPU tensors" in r[plant]


def test_moe_expert_parallel_path_is_where_cuda_needs_it(strict_run):
    """Fails with the RL old-log-prob pass returning a CPU zero (megatron's MoE schedule
    multiplies the loss by the CUDA loss scale)."""
    tmp, results = strict_run
    for r in results:
        assert torch.isfinite(torch.tensor([r["moe_ep2"]["sft_loss"],
                                            r["moe_ep2"]["rl_loss"]])).all()
    assert (tmp / "moe_hf" / "config.json").is_file()


def test_padded_rl_lengths_are_rounded_for_sequence_parallel(strict_run):
    for r in strict_run[1]:
        assert r["padded_sp"]["length"] == 12  # 11 positions rounded up to a multiple of TP 2
        assert r["padded_sp"]["error"] is None
