"""Training-state checkpoints (issue 6, checkpoint part): exact resume, TP/PP resharding of
model and optimizer, RNG restore, keep-last, and skipping partial/corrupt checkpoints.

Real megatron-core DDP + optimizer (non-distributed Adam) + OptimizerParamScheduler on a
tiny Qwen3 started from an HF checkpoint, two gloo ranks, one launch.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from megatron_klear.models.tiny import save_tiny_hf_model
from tests.dist import run_distributed

EXTRA = {"consumed_samples": 8, "data_position": {"epoch": 0, "index": 3}}


def _setup(tp: int, pp: int, hf_dir: Path):
    """DDP-wrapped model loaded from ``hf_dir`` + megatron optimizer + LR scheduler."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_klear.checkpoint import convert, hf_bridge
    from megatron_klear.models import qwen3
    from megatron_klear.distributed import initialize_parallel

    initialize_parallel(tp, pp, seed=7)
    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(hf_dir))
    config = qwen3.transformer_config(arch, tp=tp, pp=pp)
    gpt = qwen3.build_gpt_model(arch, config)
    hf_bridge.load_hf_weights([gpt], arch, convert.SafetensorsReader(hf_dir))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), module=gpt)
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3,
                                                 weight_decay=0.01,
                                                 use_distributed_optimizer=False), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3,
                                    lr_warmup_steps=2, lr_decay_steps=8,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=8, wd_incr_style="constant")
    return arch, ddp, opt, sched


def _train_step(arch, ddp, opt, sched, step: int) -> None:
    """One next-token step on a fixed batch; padded vocab slots masked out of the softmax."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ids = torch.randint(0, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
    positions = torch.arange(16).expand(2, 16)

    def forward_step(data_iterator, model):
        x = next(data_iterator)
        logits = model(x[:, :-1], positions, attention_mask=None)
        shard = logits.shape[-1]
        vocab_ids = ps.get_tensor_model_parallel_rank() * shard + torch.arange(shard)

        def loss_func(out):
            out = out.float().masked_fill(vocab_ids >= arch.vocab_size, -1e9)
            loss = vocab_parallel_cross_entropy(out, x[:, 1:]).mean()
            return loss, {"loss": loss.detach()}
        return logits, loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]),
                                model=[ddp], num_microbatches=1, seq_length=16,
                                micro_batch_size=2, forward_only=False)
    opt.step()
    sched.step(1)


def _adam_state(opt, param: torch.nn.Parameter) -> dict:
    for sub in getattr(opt, "chained_optimizers", [opt]):
        if param in sub.optimizer.state:
            return sub.optimizer.state[param]
    raise KeyError("parameter not in the optimizer")


def _as_hf(arch, ddp, opt=None, key: str | None = None) -> dict[str, torch.Tensor]:
    """This stage's weights (or one Adam state tensor per weight) under HF names, TP-gathered."""
    from megatron_klear.checkpoint import hf_bridge

    params = list(ddp.module.parameters())
    saved = [p.data for p in params]
    if key is not None:
        for p in params:
            p.data = _adam_state(opt, p)[key]
    try:
        return hf_bridge.hf_state_dict_from_megatron([ddp], arch)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _same(part: dict, full: dict) -> list[str]:
    """Names in ``part`` whose tensor differs from ``full`` (bitwise)."""
    return sorted(n for n, t in part.items() if not torch.equal(t, full[n]))


def _resume_checks(rank, world, hf_dir: Path, ckpt: Path):
    from megatron_klear.checkpoint import state

    res = {}
    # Run 1 at TP2: 2 steps, save at iteration 2, then 2 more steps (the reference).
    arch, ddp, opt, sched = _setup(2, 1, hf_dir)
    for step in (1, 2):
        _train_step(arch, ddp, opt, sched, step)
    state.save_checkpoint(ckpt, 2, [ddp], optimizer=opt, scheduler=sched, extra=EXTRA,
                          hf_config=arch.hf_config)
    saved = {k: _as_hf(arch, ddp, opt, k) for k in ("exp_avg", "exp_avg_sq")}
    saved["weights"] = _as_hf(arch, ddp)
    rng_after_save = (torch.rand(4), torch.randint(0, 1000, (4,)))
    for step in (3, 4):
        _train_step(arch, ddp, opt, sched, step)
    reference, ref_lr = _as_hf(arch, ddp), opt.param_groups[0]["lr"]

    # Run 2, same layout: exact resume (weights, Adam, LR schedule, RNG, extra).
    arch, ddp, opt, sched = _setup(2, 1, hf_dir)
    info = state.load_checkpoint(ckpt, [ddp], optimizer=opt, scheduler=sched)
    res["info"] = (info.iteration, info.extra, info.path.name, info.hf_config == arch.hf_config)
    res["rng"] = all(torch.equal(a, b) for a, b in zip(
        rng_after_save, (torch.rand(4), torch.randint(0, 1000, (4,)))))
    for step in (3, 4):
        _train_step(arch, ddp, opt, sched, step)
    res["same_layout_resume"] = _same(_as_hf(arch, ddp), reference)
    res["lr"] = (opt.param_groups[0]["lr"], ref_lr)

    # Run 3 at PP2: weights and Adam moments reshard; the common Adam step is restored.
    arch, ddp, opt, sched = _setup(1, 2, hf_dir)
    torch.manual_seed(99)  # RNG must NOT be restored across layouts
    state.load_checkpoint(ckpt, [ddp], optimizer=opt, scheduler=sched)
    res["rng_other_layout", rank] = torch.equal(torch.rand(4), rng_after_save[0])
    res["pp2_weights", rank] = _same(_as_hf(arch, ddp), saved["weights"])
    res["pp2_adam", rank] = [n for k in ("exp_avg", "exp_avg_sq")
                             for n in _same(_as_hf(arch, ddp, opt, k), saved[k])]
    res["pp2_step", rank] = {int(_adam_state(opt, p)["step"]) for p in ddp.module.parameters()}
    res["pp2_lr"] = opt.param_groups[0]["lr"], sched.num_steps
    return res


def _recovery_checks(rank, world, hf_dir: Path, root: Path):
    import torch.distributed as dist

    from megatron_klear.checkpoint import state

    res, messages = {}, []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megatron_klear.checkpoint.state").addHandler(handler)
    arch, ddp, opt, sched = _setup(1, 1, hf_dir)  # 2 data-parallel ranks
    state.save_checkpoint(root / "before_first_step", 0, [ddp], optimizer=opt)
    res["before_first_step"] = state.read_meta(root / "before_first_step" / "iter_0000000")[
        "contents"]
    _train_step(arch, ddp, opt, sched, 1)
    for it in (1, 2, 3):
        state.save_checkpoint(root, it, [ddp], optimizer=opt, scheduler=sched,
                              extra={"it": it}, keep_last=2)
    res["kept"] = sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))
    res.update({"marker": (root / state.LATEST_FILE).read_text().strip()})
    if rank == 0:  # what a kill during a save, a partial copy and a bad disk leave behind
        shutil.copytree(root / "iter_0000003", root / ".iter_0000004.tmp")
        (root / "iter_0000005").mkdir()
        shutil.copytree(root / "iter_0000003", root / "iter_0000006")
        victim = next((root / "iter_0000006").glob("*.distcp"))
        victim.write_bytes(victim.read_bytes()[:100])
    dist.barrier()
    info = state.load_checkpoint(root, [ddp], optimizer=opt, scheduler=sched)
    res["recovered"] = info.iteration, info.extra
    res["warnings"] = messages
    # A model-only checkpoint (what the converter writes) loads with an optimizer present.
    state.save_checkpoint(root / "model_only", 0, [ddp], hf_config=arch.hf_config)
    res["model_only"] = state.load_checkpoint(root / "model_only", [ddp], optimizer=opt).iteration
    return res


def _all_checks(rank, world, hf_dir: Path, root: Path):
    """Both sets of checks in one launch of 2 ranks (each sets its own layout and seeds)."""
    return (_resume_checks(rank, world, hf_dir, root / "ckpt"),
            _recovery_checks(rank, world, hf_dir, root / "recovery"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    hf_dir = save_tiny_hf_model(root / "hf", std=0.2)
    (resume0, recovery0), (resume1, _) = run_distributed(_all_checks, 2, hf_dir, root)
    return {**resume0, **resume1}, recovery0


def test_same_layout_resume_is_exact(results):
    r = results[0]
    assert r["info"] == (2, EXTRA, "iter_0000002", True)
    assert r["same_layout_resume"] == []
    assert r["lr"][0] == r["lr"][1] and r["lr"][0] > 0
    assert r["rng"]


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_checkpoint_resumes_at_pp2_with_optimizer_state(results, rank):
    r = results[0]
    assert r["pp2_weights", rank] == []
    assert r["pp2_adam", rank] == []
    assert r["pp2_step", rank] == {2}
    assert r["pp2_lr"][1] == 2
    assert not r["rng_other_layout", rank]


def test_keep_last_and_latest_marker(results):
    r = results[1]
    assert r["kept"] == ["iter_0000002", "iter_0000003"]
    assert r["marker"] == "3"


def test_partial_corrupt_and_interrupted_checkpoints_are_skipped_with_warnings(results):
    r = results[1]
    assert r["recovered"] == (3, {"it": 3})
    joined = "\n".join(r["warnings"])
    assert ".iter_0000004.tmp" in joined and "interrupted save" in joined
    assert "iter_0000005" in joined and "partial" in joined
    assert "iter_0000006" in joined and "truncated" in joined


def test_model_only_checkpoint_loads_with_an_optimizer(results):
    assert results[1]["model_only"] == 0


def test_optimizer_without_state_is_not_saved(results):
    assert results[1]["before_first_step"] == ["model"]
