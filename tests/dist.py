"""Run a test body on N gloo ranks in fresh processes (the multi-rank test harness).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each with the
torchrun environment variables set, the platform layer installed and the default process
group initialised on a free port, then calls ``fn(rank, world_size, *args)``. Exceptions in
any rank fail the test with that rank's traceback; a hung rank fails at ``timeout``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_klear.distributed import free_port


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        from megatron_klear import platform

        torch.set_num_threads(1)
        platform.setup()
        dist.init_process_group(platform.backend(), rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
            else:
                results[rank] = payload
            if errors:
                break
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
