"""Training engine: distributed + model-parallel setup, model chunks, DDP, optimizer, steps.

Parallelism is applied here and nowhere else: trainers (sft.py, rl.py) ask the engine for a
model and call :meth:`Engine.train_step` with micro-batches and a loss function.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_klear import platform
from megatron_klear.config import ConfigError, TrainConfig
from megatron_klear.distributed import initialize_parallel
from megatron_klear.models.lora import apply_lora, lora_spec
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.models.qwen3 import Qwen3Arch, build_model_chunks
from megatron_klear.models.routing_replay import replay_routing
from megatron_klear.train.adam_state import init_adam_state, untie_adam_steps
from megatron_klear.train.context_parallel import slice_batch


PEFT_SUBDIR = "peft_adapter"  # where export_hf puts a LoRA run's PEFT adapter folder
MicroBatch = dict  # "tokens", "position_ids", optional THD "cu_seqlens"/"max_seqlen", loss inputs
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def to_device(batch: MicroBatch) -> MicroBatch:
    """Move every tensor of the micro-batch to the compute device, in place (the engine's one
    place for it; loss functions may store outputs such as old log-probs in the same dict)."""
    dev = platform.device()
    batch.update({k: v.to(dev, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)})
    return batch


@dataclass
class Engine:
    """A Qwen3 model at a TP/PP layout with its DDP wrappers, optimizer and LR schedule."""

    cfg: TrainConfig
    arch: Qwen3Arch
    model: list[torch.nn.Module]
    optimizer: Any = None
    scheduler: Any = None

    @property
    def transformer_config(self):
        """The megatron TransformerConfig shared by every model chunk."""
        return self.model[0].config

    def forward_backward(self, microbatches: list[MicroBatch], loss_fn: LossFn, *,
                         forward_only: bool = False) -> list[dict]:
        """Run megatron's pipeline schedule over ``microbatches``.

        ``loss_fn(logits, batch)`` returns ``(loss, metrics)`` where ``loss`` is this
        micro-batch's share of the mini-batch loss, already divided by the GLOBAL
        normaliser (all micro-batches, all DP ranks): summing the shares gives the
        mini-batch loss. The engine undoes megatron's averaging over micro-batches and DP
        ranks so that the gradient is exactly that of the mini-batch loss. With context
        parallelism each CP rank sees (and ``loss_fn`` scores) its slice of every sequence
        (:mod:`~megatron_klear.train.context_parallel`); megatron multiplies the loss by the
        CP size and DDP averages over DP x CP, which cancel. Returns the
        per-micro-batch metrics on the last pipeline stage (an empty list elsewhere).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        scale = len(microbatches) * parallel_state.get_data_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()

        def forward_step(data_iterator, model):
            batch = slice_batch(to_device(next(data_iterator)), cp, cp_rank)
            replay_routing(model, batch.get("routed_experts"))
            logits = model(batch["tokens"], batch["position_ids"], None,
                           packed_seq_params=packed_seq_params(batch))

            def loss_func(output):
                loss, metrics = loss_fn(output, batch)
                return loss * scale, metrics

            return logits, loss_func

        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if len(self.model) > 1 and len(microbatches) < pp:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage: interleaving needs at "
                             f"least --pipeline-model-parallel-size {pp} micro-batches per "
                             f"step, got {len(microbatches)}; raise the batch size or drop "
                             "interleaving")
        # the whole length: megatron divides it by CP (and TP under SP) for the stages' sends
        b, s = schedule_shape(microbatches, self.transformer_config)
        # interleaving: every model chunk reads the micro-batches through its own iterator
        data = [iter(microbatches) for _ in self.model] if len(self.model) > 1 \
            else iter(microbatches)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.model,
                num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only)
        finally:  # other forwards (the probe, eval, export) route by their own top-k
            for chunk in self.model:
                replay_routing(chunk, None)

    def train_step(self, microbatches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on a mini-batch; returns summed metrics, grad norm and LR."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self.forward_backward(microbatches, loss_fn)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        metrics = sum_metrics(stored)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["update_skipped"] = float(not ok)
        return metrics

    def gather_params(self) -> None:
        """Make every parameter hold its updated value before it is read outside a forward.

        With ``--use-distributed-optimizer --overlap-param-gather`` the all-gather of the
        updated shards is deferred into the next forward's pre-hooks, so right after
        ``optimizer.step()`` the full parameters are stale. Weight sync, HF export and
        checkpoint save call this first. A no-op without the distributed optimizer.
        """
        if self.cfg.use_distributed_optimizer and self.optimizer is not None:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    def save(self, step: int, extra: dict) -> None:
        """Checkpoint model, optimizer, schedule, RNG and ``extra`` (data position) to --save."""
        from megatron_klear.checkpoint.state import save_checkpoint
        from megatron_klear.config import to_dict

        self.gather_params()
        save_checkpoint(self.cfg.save, step, self.model, optimizer=self.optimizer,
                        scheduler=self.scheduler, extra={**extra, "config": to_dict(self.cfg)},
                        hf_config=self.arch.hf_config, keep_last=self.cfg.keep_last,
                        trainer=type(self.cfg).trainer_name)

    def export_hf(self, out_dir: str, tokenizer_dir: str | None = None) -> None:
        """Write the model in Hugging Face format (collective; any TP/PP). With LoRA: the
        merged weights (``W + scale B A``), and the adapters as a PEFT folder in
        ``<out_dir>/peft_adapter``."""
        from megatron_klear.checkpoint.hf_io import export_model_to_hf
        from megatron_klear.checkpoint.peft_io import export_peft_adapter

        self.gather_params()
        export_model_to_hf(self.model, self.arch, out_dir, tokenizer_dir=tokenizer_dir)
        lora = lora_spec(self.cfg)
        if lora is not None:
            export_peft_adapter(self.model, lora, f"{out_dir}/{PEFT_SUBDIR}",
                                base_model=self.cfg.hf_checkpoint)

    @torch.no_grad()
    def forward_only(self, microbatches: list[MicroBatch], loss_fn: LossFn) -> list[dict]:
        """Forward passes (e.g. old log-probs); per-micro-batch outputs on the last stage."""
        for chunk in self.model:
            chunk.eval()
        try:
            return self.forward_backward(microbatches, loss_fn, forward_only=True)
        finally:
            for chunk in self.model:
                chunk.train()


def packed_seq_params(batch: MicroBatch):
    """megatron's THD ``PackedSeqParams`` of a packed micro-batch (one with ``cu_seqlens``,
    see :mod:`megatron_klear.data.packing`; with prompt sharing, ``SharedPrefixParams``), or
    None for a plain causal batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_klear.models.varlen_attention import SharedPrefixParams

    if "cu_seqlens" not in batch:
        return None
    cu, longest = batch["cu_seqlens"], int(batch["max_seqlen"])
    thd = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
               max_seqlen_kv=longest)
    if "parent_segment" in batch:
        return SharedPrefixParams(**thd, parent_segment=batch["parent_segment"])
    return PackedSeqParams(**thd)


def schedule_shape(microbatches: list[MicroBatch], config) -> tuple[int, int]:
    """(micro-batch size, sequence length) for megatron's schedule.

    Packs and padded batches differ in length from one micro-batch to the next; then
    megatron's ``variable_seq_lengths`` makes the pipeline stages exchange each activation's
    shape before sending it (one extra small message per micro-batch, PP only).
    """
    shapes = {tuple(mb["tokens"].shape) for mb in microbatches}
    config.variable_seq_lengths = len(shapes) > 1
    return max(shapes)


def sum_metrics(per_microbatch: list[dict]) -> dict[str, float]:
    """Sum scalar metrics over micro-batches and DP (x CP) ranks, then share them with every
    rank."""
    totals: dict[str, float] = {}
    for m in per_microbatch:
        for k, v in m.items():
            if torch.is_tensor(v) and v.numel() == 1:
                totals[k] = totals.get(k, 0.0) + float(v.detach())
    keys = sorted(totals)
    if keys:
        vec = torch.tensor([totals[k] for k in keys], dtype=torch.float64,
                           device=platform.device())
        dist.all_reduce(vec, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        totals = dict(zip(keys, vec.tolist()))
    return broadcast_from_last_stage(totals)


def broadcast_from_last_stage(obj: Any) -> Any:
    """Share a picklable object from the last pipeline stage with every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return obj
    holder = [obj]
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(holder, src=src,
                               group=parallel_state.get_pipeline_model_parallel_group())
    return holder[0]


def data_parallel_all_reduce(value: float | torch.Tensor) -> torch.Tensor:
    """Sum a number over data-parallel ranks (global token counts for the loss normaliser;
    the CP ranks of a DP rank hold the same full micro-batches, so CP is not summed)."""
    t = torch.as_tensor(value, dtype=torch.float64).to(platform.device(), copy=True)
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t


def build_model(arch: Qwen3Arch, cfg: TrainConfig, *, wrap_ddp: bool = True) -> list[torch.nn.Module]:
    """The model chunks of this rank (one per virtual pipeline stage, models/qwen3.py
    :func:`build_model_chunks`), built on the device, optionally wrapped in megatron DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    chunks = build_model_chunks(arch, cfg)
    lora = lora_spec(cfg)
    if lora is not None:  # frozen base + adapters, before DDP sizes its grad buffers
        for chunk in chunks:
            apply_lora(chunk, arch, lora, seed=cfg.seed)
    if not wrap_ddp:
        return chunks
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    return [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c,
                                    disable_bucketing=i > 0)  # as megatron-LM does for chunks
            for i, c in enumerate(chunks)]


def build_optimizer(model: list[torch.nn.Module], cfg: TrainConfig):
    """megatron-core AdamW (distributed over DP ranks with --use-distributed-optimizer) and its
    LR/WD scheduler; hooks the schedule up."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=cfg.bf16,
        params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        optimizer_cpu_offload=cfg.optimizer_cpu_offload,
        optimizer_offload_fraction=1.0 if cfg.optimizer_cpu_offload else 0.0,
        # Megatron-LM requires it with offload: without it the fp32 master weights stay on
        # the GPU and the offloaded copies are never refreshed from loaded weights
        use_precision_aware_optimizer=cfg.optimizer_cpu_offload)
    optimizer = get_megatron_optimizer(opt_cfg, model)
    if cfg.use_distributed_optimizer:
        init_adam_state(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr if cfg.lr_decay_style != "constant" else cfg.lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=max(cfg.decay_iters, 1),
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=max(cfg.decay_iters, 1), wd_incr_style="constant")
    tconf = model[0].config
    tconf.finalize_model_grads_func = finalize_model_grads
    tconf.grad_scale_func = optimizer.scale_loss
    tconf.no_sync_func = [c.no_sync for c in model] if len(model) > 1 else model[0].no_sync
    return optimizer, scheduler


def cpu_threads(requested: int | None = None) -> int:
    """Torch CPU threads of this rank: ``requested`` (``--cpu-threads``), else this node's
    cores split evenly among its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    if requested:
        return requested
    local = int(os.environ.get("LOCAL_WORLD_SIZE",
                               dist.get_world_size() if dist.is_initialized() else 1))
    return max(1, len(os.sched_getaffinity(0)) // local)


def _parallel_layout(tp: int, pp: int, vpp: int | None, cp: int, ep: int, etp: int | None
                     ) -> tuple:
    """A parallel layout as megatron's parallel state reports it (``etp`` None: ``tp``)."""
    return (tp, pp, vpp, cp, ep, etp or tp)


def _current_layout() -> tuple:
    ps = parallel_state
    return _parallel_layout(ps.get_tensor_model_parallel_world_size(),
                            ps.get_pipeline_model_parallel_world_size(),
                            ps.get_virtual_pipeline_model_parallel_world_size(),
                            ps.get_context_parallel_world_size(),
                            ps.get_expert_model_parallel_world_size(),
                            ps.get_expert_tensor_parallel_world_size())


def build_engine(cfg: TrainConfig, arch: Qwen3Arch, *, with_optimizer: bool = True) -> Engine:
    """Initialise parallel state (kept when it already has ``cfg``'s layout, made again
    when it has another: a second trainer in one process at another TP must not run on the
    first one's groups) and build the model, optimizer and schedule."""
    vpp = PipelineLayout.from_config(arch.num_layers, cfg).virtual_size
    wanted = _parallel_layout(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                              vpp, cfg.context_parallel_size, cfg.expert_model_parallel_size,
                              cfg.expert_tp)
    if not parallel_state.model_parallel_is_initialized() or _current_layout() != wanted:
        initialize_parallel(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                            cfg.seed, cp=cfg.context_parallel_size, vpp=vpp,
                            ep=cfg.expert_model_parallel_size, etp=cfg.expert_tp)
    if dist.is_initialized():
        cfg.data_parallel_size(dist.get_world_size())
    torch.set_num_threads(cpu_threads(cfg.cpu_threads))
    model = build_model(arch, cfg, wrap_ddp=with_optimizer)
    engine = Engine(cfg=cfg, arch=arch, model=model)
    if with_optimizer:
        engine.optimizer, engine.scheduler = build_optimizer(model, cfg)
    return engine


def restore_or_init(engine: Engine, *, with_optimizer: bool = True):
    """Resume from a checkpoint of this trainer, else take a checkpoint's or HF weights.

    An own checkpoint under ``--load`` (unless ``--finetune``), else under ``--save`` (a
    restarted job), resumes: weights, optimizer and schedule (unless ``--no-load-optim``),
    RNG (unless ``--no-load-rng``) and the data position in ``extra``. A checkpoint of
    another trainer or of the converter, or any one with ``--finetune``, gives the weights
    only (one log line says so) and the run starts at step 0. Without a checkpoint the
    ``--hf-checkpoint`` weights are loaded. A LoRA run (``--lora-rank``) first loads its
    frozen base (``--load``'s full checkpoint, else ``--hf-checkpoint``); the rules above
    then apply to LoRA (adapters-only) checkpoints, and a run that does not resume takes its
    adapters from ``--lora-load``'s PEFT folder when given, see docs/lora.md.

    Returns the :class:`~megatron_klear.checkpoint.state.CheckpointInfo` of a resumed run,
    or None for a run that starts at step 0.
    """
    from megatron_klear.checkpoint.hf_io import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.peft_io import load_peft_adapter
    from megatron_klear.checkpoint.state import load_checkpoint

    cfg = engine.cfg
    lora = lora_spec(cfg) is not None
    if lora:  # the frozen base first; the adapters then come from a LoRA checkpoint, if any
        _load_lora_base(engine)
    src, resume = pick_checkpoint(cfg)
    if src is not None and not resume and cfg.lora_load:
        raise ConfigError(f"--lora-load {cfg.lora_load} and the LoRA checkpoint under {src} both "
                          "give the adapters to start from: drop one")
    if src is not None:
        restore = resume and not cfg.no_load_optim and with_optimizer
        info = load_checkpoint(src, engine.model,
                               optimizer=engine.optimizer if restore else None,
                               scheduler=engine.scheduler if restore else None,
                               load_rng=resume and not cfg.no_load_rng,
                               hf_config=engine.arch.hf_config)
        if with_optimizer:
            _after_weight_load(engine, info.optimizer_restored)
        if resume:
            return info
        if dist.get_rank() == 0:
            print(f"[load] {info.path}: {_weights_only_reason(cfg, info)}: took its weights "
                  "only; starting at step 0 with a fresh optimizer, LR schedule and data "
                  "cursor", file=sys.stderr, flush=True)
        return None
    if cfg.hf_checkpoint and not lora:
        load_hf_weights(engine.model, engine.arch, SafetensorsReader(cfg.hf_checkpoint))
    if cfg.lora_load:  # a PEFT adapter to start from (a resumed run has its own adapters)
        load_peft_adapter(engine.model, lora_spec(cfg), cfg.lora_load)
    if with_optimizer and (cfg.hf_checkpoint or lora):
        _after_weight_load(engine, optimizer_restored=False)
    return None


def _load_lora_base(engine: Engine) -> None:
    """A LoRA run's frozen base: the full (not LoRA) checkpoint under ``--load``, else the
    ``--hf-checkpoint`` weights."""
    from megatron_klear.checkpoint.hf_io import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.state import find_latest_checkpoint, load_checkpoint, read_meta

    cfg = engine.cfg
    path = find_latest_checkpoint(cfg.load) if cfg.load else None
    if path is not None and not read_meta(path).get("lora"):
        load_checkpoint(path, engine.model, load_rng=False, hf_config=engine.arch.hf_config)
    elif cfg.hf_checkpoint:
        load_hf_weights(engine.model, engine.arch, SafetensorsReader(cfg.hf_checkpoint))


def pick_checkpoint(cfg: TrainConfig) -> tuple[str | None, bool]:
    """(directory to load, whether to resume from it) for :func:`restore_or_init`.

    Resumes an own checkpoint under ``--load`` (not with ``--finetune``), then one under
    ``--save`` when that is another directory (the job restarted after it saved); otherwise
    the weights of ``--load``'s (or ``--save``'s) checkpoint, whoever wrote it.
    A LoRA run considers only LoRA (adapter) checkpoints here: a full one is its base.
    """
    from megatron_klear.checkpoint.state import find_latest_checkpoint, read_meta

    found = {}
    lora = lora_spec(cfg) is not None
    for src in dict.fromkeys(s for s in (cfg.load, cfg.save) if s):
        path = find_latest_checkpoint(src)
        if path is not None and not (lora and not read_meta(path).get("lora")):
            found[src] = is_own_checkpoint(read_meta(path), cfg)
    if found.get(cfg.load) and not cfg.finetune:
        return cfg.load, True
    if cfg.save != cfg.load and found.get(cfg.save):
        return cfg.save, True
    return next(iter(found), None), False


def is_own_checkpoint(meta: dict, cfg: TrainConfig) -> bool:
    """Whether a checkpoint (its meta) was written by the trainer that ``cfg`` drives.

    Checkpoints saved before the trainer was recorded count as own unless they are the
    converter's (iteration 0), as before.
    """
    if meta.get("trainer") is None:
        return meta["iteration"] > 0
    return meta["trainer"] == type(cfg).trainer_name


def _weights_only_reason(cfg: TrainConfig, info) -> str:
    """Why :func:`restore_or_init` took only the weights of a checkpoint (for its log line)."""
    if info.trainer == type(cfg).trainer_name or (info.trainer is None and info.iteration):
        return "--finetune"
    writer = "the HF -> Megatron converter" if info.trainer == "convert" or info.iteration == 0 \
        else f"klear-{info.trainer}"
    return f"written by {writer} (iteration {info.iteration}), not by klear-{type(cfg).trainer_name}"


def _after_weight_load(engine: Engine, optimizer_restored: bool) -> None:
    """Bring the optimizer in line with weights loaded into the model.

    Without restored optimizer state, the fp32 main params that megatron's bf16 and
    distributed optimizers copied from the randomly initialised model at construction must
    be refreshed, or the first step would write the random weights back. After a restore,
    the distributed optimizer's Adam steps are untied (see adam_state.py).
    """
    if not optimizer_restored:
        engine.optimizer.reload_model_params()
    elif engine.cfg.use_distributed_optimizer:
        untie_adam_steps(engine.optimizer)
