"""``--dry-run``: validate a launch without GPUs or data and print its memory plan.

Checks the DP size against the launch (``WORLD_SIZE``), the TP/PP/CP split (uneven and
interleaved stages included) against the model (when ``--hf-checkpoint``'s config.json
is on this machine), and plans per-GPU memory with
:mod:`megatron_klear.train.memory`. A plan that does not fit ``--gpu-memory-gb`` fails with
a :class:`~megatron_klear.config.ConfigError` naming the flags that would make it fit.
With ``--colocate`` (klear-rl) it plans the phases of a colocated step instead
(:func:`~megatron_klear.train.memory.plan_colocated`: training with the engines released,
the weight sync, rollout with the trainer offloaded) and fails when one does not fit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_klear.config import TrainConfig, to_dict
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.models.qwen3 import check_parallel_layout, load_hf_config, \
    moe_config_kwargs, qwen3_config_from_hf
from megatron_klear.train.memory import Workload, check_colocated_fits, check_fits, \
    plan_colocated, plan_memory

__all__ = ["dry_run"]


def dry_run(cfg: TrainConfig, workload: Workload | None = None) -> dict:
    """Print the config and the dry-run report (JSON); raise when the plan does not fit."""
    world = int(os.environ.get("WORLD_SIZE", cfg.tensor_model_parallel_size *
                               cfg.pipeline_model_parallel_size * cfg.context_parallel_size))
    report: dict = {"world_size": world, "data_parallel_size": cfg.data_parallel_size(world)}
    plan = arch = None
    if cfg.hf_checkpoint and (Path(cfg.hf_checkpoint) / "config.json").is_file():
        arch = qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint))
        layout = check_parallel_layout(arch, cfg.tensor_model_parallel_size,
                                       cfg.pipeline_model_parallel_size,
                                       PipelineLayout.from_config(arch.num_layers, cfg))
        moe_config_kwargs(arch, ep=cfg.expert_model_parallel_size, etp=cfg.expert_tp,
                          dispatcher=cfg.moe_token_dispatcher_type)  # raises on a bad EP
        report["model"] = f"{arch.num_layers} layers, hidden {arch.hidden_size}" + (
            f", {arch.num_experts} experts (top-{arch.num_experts_per_tok}) in "
            f"{len(arch.moe_layers)} layers" if arch.is_moe else "")
        report["pipeline_stage_layers"] = list(layout.stage_layers)
        report["model_chunks_per_stage"] = layout.num_model_chunks
        workload = workload or Workload(cfg.seq_length)
        plan = plan_memory(arch, cfg, world, workload)
        report["memory"] = {**plan.as_dict(), "gpu_memory_gb": cfg.gpu_memory_gb,
                            "fits": plan.fits(cfg.gpu_memory_gb),
                            "fused_loss": workload.fused_loss}
        if workload.reference_on_host:  # the reference's copy and the policy's stash
            host = 2 * max(st.params for st in plan.stages)
            report["memory"]["kl_reference_host_gib_per_rank"] = round(host / 2**30, 2)
        if getattr(cfg, "colocate", False):  # klear-rl --colocate: both phases per GPU
            colocated = plan_colocated(arch, cfg, plan, workload.seq_length)
            report["colocated"] = colocated.as_dict()
    else:
        report["model"] = "not checked (--hf-checkpoint is not on this machine)"
        report["memory"] = "not planned (needs the model's config.json)"
    print(json.dumps({"config": to_dict(cfg), "dry_run": report}, indent=2, default=str),
          flush=True)
    if "colocated" in report:
        check_colocated_fits(colocated, arch, cfg, world, workload, plan)
    elif plan is not None:
        check_fits(plan, arch, cfg, world, workload)
    return report
