"""2-GPU smoke test of the GPU path (issue 13). NEVER RUN YET: no GPU was lent while writing it.

    torchrun --nproc-per-node 2 tests/gpu/smoke_2gpu.py [--dir SHARED_DIR]
                                                               (or tests/gpu/run_gpu_checks.sh)

Transformer Engine layer spec, TP2 with sequence parallel, full recompute, the distributed
optimizer with overlapped grad reduce and param gather, bf16, the CUDA loss kernel
(``--loss-backend auto`` must resolve to ``cuda``). One SFT step, the RL old-log-prob pass and
one RL step, then a checkpoint save and an HF export. Checks that parameters, grads, optimizer
state and losses live on the GPU and that the steps are finite; prints ``SMOKE OK``. The CPU
twin of these checks is tests/multiprocess/test_placement.py (strict virtual-CUDA mode).

Issue 30 (not run on a GPU yet): a padded (--no-pack-sequences) RL step whose longest sample
gives 11 positions, which SP can split over TP 2 only once rounded (defect 7); and Transformer
Engine checkpoints (defect 3): a tiny HF model converted by convert_hf_to_megatron loads into
the TE model (its norms save TE "extra state"), whose log-probs match transformers, and the
TE model's own checkpoint converts back to the HF input's tensors (the CPU twin with a
stand-in TE norm is tests/multiprocess/test_te_checkpoints.py).

Every rank works in ONE folder (issue 38, defect 5): the checkpoint save, the HF export and
the converters are collective, each rank writing its share of the same directory, so rank 0
makes the folder (or takes ``--dir``) and broadcasts its path. The repository root goes on
``sys.path`` so the script runs as written above (``tests`` and the worktree's
``megatron_klear`` import without PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`, the worktree's package

VOCAB, SEQ = 512, 64


def shared_dir(path: str | None) -> Path:
    """One folder for every rank: ``path``, or a temp folder made by rank 0, broadcast.

    Initialises the default process group (NCCL, torchrun's environment) so the broadcast can
    run before the engine is built; build_engine keeps a group that exists."""
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    box = [path or (tempfile.mkdtemp(prefix="klear_smoke_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    Path(box[0]).mkdir(parents=True, exist_ok=True)
    return Path(box[0])


def sft_and_rl_steps(eng, cfg) -> dict:
    """One SFT step, the RL old-log-prob pass and one RL step on two random micro-batches of
    ``SEQ`` tokens; the losses and whether grads and optimizer state live on the GPU."""
    from megatron_klear.algo.rl_objective import PolicyLossFlags, old_logprobs, policy_loss_fn
    from megatron_klear.train.sft import sft_loss_fn

    vocab = eng.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    mbs = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=g)
        mask = torch.ones(1, SEQ)
        mbs.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask,
                        position_ids=torch.arange(SEQ)[None], positive=mask,
                        advantages=torch.randn(1, SEQ, generator=g),
                        rollout_logprobs=-torch.rand(1, SEQ, generator=g)))
    total = float(sum(mb["loss_mask"].sum() for mb in mbs))
    sft = eng.train_step(mbs, sft_loss_fn(vocab, total, "cuda"))
    grads_on_gpu = all(p.main_grad.is_cuda for p in eng.model[0].parameters())
    old_logprobs(eng, mbs, vocab, 1.0)
    rl = eng.train_step(mbs, policy_loss_fn(cfg.part(PolicyLossFlags), vocab, total, total,
                                            backend=cfg.loss_backend))
    state = [t for part in getattr(eng.optimizer, "chained_optimizers", [eng.optimizer])
             for s in part.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"sft_loss": float(sft["loss"]), "rl_loss": float(rl["train/loss"]),
            "grads_on_gpu": grads_on_gpu, "state_tensors": state,
            "finite": bool(torch.isfinite(torch.tensor([sft["loss"], rl["train/loss"]])).all())}


def main() -> None:
    import torch.distributed as dist

    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.ops.backend import loss_backend
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from tests.multiprocess.test_placement import _padded_sp_step

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="a folder every rank sees (default: a temp folder of rank 0)")
    args = ap.parse_args()
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 2, "needs 2 GPUs"
    tmp = shared_dir(args.dir)
    cfg = RLConfig(tensor_model_parallel_size=2, sequence_parallel=True, bf16=True,
                   transformer_impl="transformer_engine", recompute_granularity="full",
                   recompute_method="uniform", recompute_num_layers=1,
                   use_distributed_optimizer=True, overlap_grad_reduce=True,
                   overlap_param_gather=True, global_batch_size=2, micro_batch_size=1,
                   seq_length=SEQ, save=str(tmp / "ckpt"))
    TrainConfig.validate(cfg)  # the shared flags (RLConfig's own need prompt data)
    eng = build_engine(cfg, qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB)))
    assert loss_backend(cfg.loss_backend) == "cuda", "the extension lacks its CUDA kernels"
    assert all(p.is_cuda for p in eng.model[0].parameters())

    steps = sft_and_rl_steps(eng, cfg)
    eng.save(2, {})
    eng.export_hf(str(tmp / "hf"))
    dist.barrier()  # rank 0 wrote the export's config.json; every rank reads it
    ok = (steps["grads_on_gpu"] and steps["finite"]
          and all(t.is_cuda or t.dim() == 0 for t in steps["state_tensors"])
          and (tmp / "hf" / "config.json").is_file())
    padded = _padded_sp_step(eng)
    ok = ok and padded["length"] == 12 and padded["error"] is None
    te_checkpoints(cfg, tmp)
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"rank {dist.get_rank()}: sft loss {steps['sft_loss']:.4f}, "
          f"rl loss {steps['rl_loss']:.4f},"
          f" peak {peak:.0f} MiB, {'SMOKE OK' if ok else 'SMOKE FAILED'}", flush=True)
    if not ok:
        raise SystemExit(1)


def te_checkpoints(cfg, tmp: Path) -> None:
    """Defect 3: the converter's checkpoint loads into the TE model (fp32) and gives
    transformers' log-probs; the TE model's checkpoint converts back to the HF tensors.
    ``tmp`` is the ranks' shared folder: rank 0 writes the HF model, the converters and the
    save are collective over it."""
    from dataclasses import replace

    import torch.distributed as dist

    from safetensors.torch import load_file

    from megatron_klear.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs
    from megatron_klear.train.engine import build_engine, restore_or_init
    from tests.rollout_helpers import load_reference, make_tiny_model, reference_logprobs

    if dist.get_rank() == 0:
        make_tiny_model(tmp / "tiny")
    dist.barrier()
    hf = tmp / "tiny"
    convert_hf_to_megatron(hf, tmp / "from_hf")
    te_cfg = replace(cfg, bf16=False, load=str(tmp / "from_hf"), save=str(tmp / "te_ckpt"),
                     use_distributed_optimizer=False, overlap_grad_reduce=False,
                     overlap_param_gather=False)
    eng = build_engine(te_cfg, qwen3_config_from_hf(load_hf_config(hf)))
    restore_or_init(eng)
    ids = list(range(3, 40, 2))
    lp = trainer_sequence_logprobs(eng.model, eng.arch, ids)
    diff = float((lp.cpu() - reference_logprobs(load_reference(hf)[0], ids)).abs().max())
    eng.save(1, {})
    convert_megatron_to_hf(tmp / "te_ckpt", tmp / "back")
    dist.barrier()  # every rank's shards written
    src, back = load_file(str(next(hf.glob("*.safetensors")))), {}
    for f in (tmp / "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    same = all(torch.equal(src[k], back[k]) for k in src)
    print(f"TE checkpoints: logprob diff {diff:.2e}, round trip equal {same}", flush=True)
    if diff > 1e-3 or not same:
        raise SystemExit("TE checkpoints: FAILED")


if __name__ == "__main__":
    main()
