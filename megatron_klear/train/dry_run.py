"""The checks every launch runs before it builds anything, and ``--dry-run``.

:func:`preflight` is the one function a real run and the dry run both call, right after
the flags parse (which validated them, section by section): the DP size against the launch
(``WORLD_SIZE``), the model's config.json (the TP/PP/CP split, uneven and interleaved stages
included, expert parallelism, flags that need an MoE model), the data files and the reward
(each config section's ``check_inputs_section``); then the values that depend on the
model are derived. A real run needs ``--hf-checkpoint``'s config.json; the dry run checks
the model only when it is on this machine.

:func:`dry_run` then plans per-GPU memory with :mod:`megatron_klear.train.memory`. A plan
that does not fit ``--gpu-memory-gb`` fails with a :class:`~megatron_klear.config.ConfigError`
naming the flags that would make it fit; the host memory per node (pinned and total,
:func:`~megatron_klear.train.memory.plan_host`) is printed and checked against
``--host-memory-gb``. With ``--colocate`` (klear-rl) it plans the phases
of a colocated step instead (:func:`~megatron_klear.train.memory.plan_colocated`: training
with the engines released, the weight sync, rollout with the trainer offloaded) and fails
when one does not fit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_klear import platform
from megatron_klear.config import TrainConfig, to_dict
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.models.qwen3 import Qwen3Arch, check_parallel_layout, load_hf_config, \
    moe_config_kwargs, qwen3_config_from_hf
from megatron_klear.train.memory import Workload, check_colocated_fits, check_fits, \
    check_host_fits, plan_colocated, plan_host, plan_memory

__all__ = ["launch_world_size", "model_arch", "preflight", "dry_run", "ranks_per_node"]


def launch_world_size(cfg: TrainConfig, dry: bool) -> int:
    """The processes of this launch: ``WORLD_SIZE``, else one DP replica for a dry run
    (TP x PP x CP) and one process for a real run."""
    default = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * \
        cfg.context_parallel_size if dry else 1
    return int(os.environ.get("WORLD_SIZE", default))


def model_arch(cfg: TrainConfig, required: bool) -> Qwen3Arch | None:
    """``--hf-checkpoint``'s architecture, checked against the parallel layout; None when
    not ``required`` (a dry run) and the model folder is not on this machine (a folder that
    is here must hold a config.json, in the dry run as in a real run)."""
    if not required and not (cfg.hf_checkpoint and Path(cfg.hf_checkpoint).exists()):
        return None
    arch = qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint))
    check_parallel_layout(arch, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                          PipelineLayout.from_config(arch.num_layers, cfg))
    moe_config_kwargs(arch, ep=cfg.expert_model_parallel_size, etp=cfg.expert_tp,
                      dispatcher=cfg.moe_token_dispatcher_type)  # raises on a bad EP
    return arch


def preflight(cfg: TrainConfig) -> Qwen3Arch | None:
    """Check a parsed config against the launch, the model and the files on this machine,
    then derive the model-dependent values; returns the architecture (None: see
    :func:`model_arch`). Raises ConfigError / DataError naming the flag or FILE:LINE."""
    platform.cpu_gemm_choice()  # the one environment variable the CPU path reads
    cfg.data_parallel_size(launch_world_size(cfg, cfg.dry_run))
    arch = model_arch(cfg, required=not cfg.dry_run)
    cfg.check_inputs(arch)
    cfg.derive(arch)
    return arch


def dry_run(cfg: TrainConfig, workload: Workload | None = None) -> dict:
    """Print the config and the dry-run report (JSON); raise when the plan does not fit.
    (The trainers run :func:`preflight` first.)"""
    world = launch_world_size(cfg, dry=True)
    report: dict = {"world_size": world, "data_parallel_size": cfg.data_parallel_size(world)}
    arch = model_arch(cfg, required=False)
    plan = None
    if arch is not None:
        layout = PipelineLayout.from_config(arch.num_layers, cfg)
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
        if workload.teacher is not None:  # the Megatron OPD teacher: host, device in its forward
            teacher = round(max(st.teacher for st in plan.stages) / 2**30, 2)
            report["memory"]["opd_teacher"] = {
                "model": f"{workload.teacher.num_layers} layers, hidden "
                         f"{workload.teacher.hidden_size}",
                "host_gib_per_rank": teacher, "device_gib_per_rank_in_its_forward": teacher}
        if getattr(cfg, "colocate", False):  # klear-rl --colocate: both phases per GPU
            colocated = plan_colocated(arch, cfg, plan, workload.seq_length)
            report["colocated"] = colocated.as_dict()
        host = plan_host(plan, workload, ranks_per_node(world), getattr(cfg, "colocate", False))
        report["host"] = {**host.as_dict(), "host_memory_gb": cfg.host_memory_gb,
                          "fits": cfg.host_memory_gb is None
                          or host.total <= cfg.host_memory_gb * 2**30}
    else:
        report["model"] = "not checked (--hf-checkpoint is not on this machine)"
        report["memory"] = "not planned (needs the model's config.json)"
    print(json.dumps({"config": to_dict(cfg), "dry_run": report}, indent=2, default=str),
          flush=True)
    if "colocated" in report:
        check_colocated_fits(colocated, arch, cfg, world, workload, plan)
    elif plan is not None:
        check_fits(plan, arch, cfg, world, workload)
    if plan is not None:
        check_host_fits(host, cfg)
    return report


def ranks_per_node(world: int) -> int:
    """Trainer processes on a node: torchrun's ``LOCAL_WORLD_SIZE``, else the launch's
    ranks up to 8 (one node of 8 GPUs)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or min(world, 8))
