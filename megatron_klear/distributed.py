"""torch.distributed and megatron's parallel state for one process of a job: the trainers
(train/engine.py), the converters and compare_logits (checkpoint/convert.py) and the weight
sync's rendezvous all start here, so none of them imports another's module for it."""

from __future__ import annotations

import contextlib
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear import platform

__all__ = ["free_port", "free_port_range", "initialize_parallel", "seed_everything"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a server or rendezvous bound a moment later:
    drawn as :func:`free_port_range` draws (a port the kernel hands out for ``bind(0)`` is in
    the ephemeral range, where any process's outgoing connection can take it before then)."""
    return free_port_range(1, host)


def free_port_range(count: int, host: str = "127.0.0.1", tries: int = 100) -> int:
    """The first of ``count`` consecutive TCP ports free on ``host`` right now, for launchers
    that place servers at BASE_PORT + i. Drawn at random below Linux's ephemeral range
    (32768+), where client sockets (this process's, or another's on the host) would otherwise
    take BASE_PORT + i between draw and bind."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20000, 32768 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on {host} in {tries} tries")


def initialize_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, *, vpp: int | None = None,
                        cp: int = 1, ep: int = 1, etp: int | None = None) -> platform.Platform:
    """Initialise torch.distributed from the torchrun environment and megatron's parallel state.

    ``ep`` / ``etp``: expert-parallel and expert-tensor-parallel sizes (MoE; megatron carves
    the EP group out of the data-parallel ranks).

    Works under torchrun (env://) and when the default group already exists (tests).
    Seeds python, numpy, torch and megatron's model-parallel RNG tracker.
    """
    from megatron.core import parallel_state, tensor_parallel

    plat = platform.setup()
    if not dist.is_initialized():
        if "MASTER_PORT" in os.environ:  # torchrun (or a caller that set the rendezvous)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            dist.init_process_group(plat.backend)
        else:  # one process, not under torchrun: a private free port, kept out of os.environ
            # so that the subprocesses this process starts never inherit a port it holds
            dist.init_process_group(plat.backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
                         f" x --context-parallel-size {cp} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             context_parallel_size=cp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return plat


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (megatron's tracker is seeded separately)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
