"""2-GPU smoke test of the GPU path (issue 13). NEVER RUN YET: no GPU was lent while writing it.

    torchrun --nproc-per-node 2 tests/gpu/smoke_2gpu.py        (or tests/gpu/run_gpu_checks.sh)

Transformer Engine layer spec, TP2 with sequence parallel, full recompute, the distributed
optimizer with overlapped grad reduce and param gather, bf16, the CUDA loss kernel
(``--loss-backend auto`` must resolve to ``cuda``). One SFT step, the RL old-log-prob pass and
one RL step, then a checkpoint save and an HF export. Checks that parameters, grads, optimizer
state and losses live on the GPU and that the steps are finite; prints ``SMOKE OK``. The CPU
twin of these checks is tests/test_placement.py (strict virtual-CUDA mode).

Issue 30 (not run on a GPU yet): a padded (--no-pack-sequences) RL step whose longest sample
gives 11 positions, which SP can split over TP 2 only once rounded (defect 7); and Transformer
Engine checkpoints (defect 3): a tiny HF model converted by convert_hf_to_megatron loads into
the TE model (its norms save TE "extra state"), whose log-probs match transformers, and the
TE model's own checkpoint converts back to the HF input's tensors (the CPU twin with a
stand-in TE norm is tests/test_te_checkpoints.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

VOCAB, SEQ = 512, 64


def main() -> None:
    import torch.distributed as dist

    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.ops.backend import loss_backend
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.algo.rl_loss import old_logprobs, policy_loss_fn
    from megatron_klear.train.sft import sft_loss_fn
    from tests.test_placement import _padded_sp_step

    assert torch.cuda.is_available() and torch.cuda.device_count() >= 2, "needs 2 GPUs"
    tmp = Path(tempfile.mkdtemp(prefix="klear_smoke_"))
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

    g = torch.Generator().manual_seed(0)
    mbs = []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        mask = torch.ones(1, SEQ)
        mbs.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask,
                        position_ids=torch.arange(SEQ)[None], positive=mask,
                        advantages=torch.randn(1, SEQ, generator=g),
                        rollout_logprobs=-torch.rand(1, SEQ, generator=g)))
    total = float(sum(mb["loss_mask"].sum() for mb in mbs))
    sft = eng.train_step(mbs, sft_loss_fn(VOCAB, total, "cuda"))
    grads_on_gpu = all(p.main_grad.is_cuda for p in eng.model[0].parameters())
    old_logprobs(eng, mbs, VOCAB, 1.0)
    rl = eng.train_step(mbs, policy_loss_fn(cfg, VOCAB, total, total))
    state = [t for part in getattr(eng.optimizer, "chained_optimizers", [eng.optimizer])
             for s in part.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    eng.save(2, {})
    eng.export_hf(str(tmp / "hf"))
    ok = (grads_on_gpu and all(t.is_cuda or t.dim() == 0 for t in state)
          and torch.isfinite(torch.tensor([sft["loss"], rl["train/loss"]])).all()
          and (tmp / "hf" / "config.json").is_file())
    padded = _padded_sp_step(eng)
    ok = ok and padded["length"] == 12 and padded["error"] is None
    te_checkpoints(cfg, tmp)
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"rank {dist.get_rank()}: sft loss {sft['loss']:.4f}, rl loss {rl['train/loss']:.4f},"
          f" peak {peak:.0f} MiB, {'SMOKE OK' if ok else 'SMOKE FAILED'}", flush=True)
    if not ok:
        raise SystemExit(1)


def te_checkpoints(cfg, tmp: Path) -> None:
    """Defect 3: the converter's checkpoint loads into the TE model (fp32) and gives
    transformers' log-probs; the TE model's checkpoint converts back to the HF tensors."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from megatron_klear.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.rollout.probe import trainer_sequence_logprobs
    from megatron_klear.train.engine import build_engine, restore_or_init
    from tests.rollout_helpers import load_reference, make_tiny_model, reference_logprobs

    hf = make_tiny_model(tmp / "tiny")
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
    src, back = load_file(str(next(hf.glob("*.safetensors")))), {}
    for f in (tmp / "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    same = all(torch.equal(src[k], back[k]) for k in src)
    print(f"TE checkpoints: logprob diff {diff:.2e}, round trip equal {same}", flush=True)
    if diff > 1e-3 or not same:
        raise SystemExit("TE checkpoints: FAILED")


if __name__ == "__main__":
    main()
