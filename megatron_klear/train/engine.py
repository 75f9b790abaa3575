"""Training engine: distributed + model-parallel setup, model chunks, DDP, optimizer, steps.

Parallelism is applied here and nowhere else: trainers (sft.py, rl.py) ask the engine for a
model and call :meth:`Engine.train_step` with micro-batches and a loss function.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear import platform


def initialize_parallel(tp: int = 1, pp: int = 1, seed: int = 1234) -> platform.Platform:
    """Initialise torch.distributed from the torchrun environment and megatron's parallel state.

    Works under torchrun (env://) and when the default group already exists (tests).
    Seeds python, numpy, torch and megatron's model-parallel RNG tracker.
    """
    from megatron.core import parallel_state, tensor_parallel

    plat = platform.setup()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(plat.backend)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
                         f" does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return plat


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (megatron's tracker is seeded separately)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
