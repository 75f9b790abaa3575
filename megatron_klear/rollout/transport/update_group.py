"""The weight-update process group shared by the trainer (rank 0) and the rollout servers.

Formed through the same torch path as SGLang's receiving side,
``sglang.srt.utils.common.init_custom_process_group`` (called from
``sglang/srt/model_executor/model_runner_components/weight_updater.py``): a ``tcp://`` rendezvous
(rank 0 hosts the TCP store, listening on all interfaces), ``PrefixStore(group_name, store)``,
then torch's ``_new_process_group_helper``, which adds its own ``"{group_name}/"`` key prefix.
The key layout is torch's, so both ends agree by construction; a hand-made store prefix does
not (the group never forms against real SGLang). The trainer side (weight_sync.py) and the
embedded server both use :func:`open_update_group`.

Under torchrun, ``TORCHELASTIC_USE_AGENT_STORE=True`` makes torch's ``tcp://`` rendezvous
connect to the elastic agent's store instead of hosting one; the update group's rank 0 (the
trainer) must host its own store, so the variable is cleared for the rendezvous.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from megatron_klear import virtual_cuda

__all__ = ["UpdateGroup", "open_update_group", "DTYPES", "parse_dtype", "routable_address",
           "is_local_address"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "uint8": torch.uint8, "int64": torch.int64}

_ENV_LOCK = threading.Lock()


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16`` (ValueError names the value)."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang requests use)."""
    return str(dtype).removeprefix("torch.")


def routable_address(server_url: str) -> str:
    """This host's address on the route to ``server_url`` (what the server must dial).

    127.0.0.1 for a local server; the outward interface's address for a server on another
    node (a UDP ``connect`` picks the route without sending a packet).
    """
    host = urlsplit(server_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def is_local_address(address: str) -> bool:
    """Whether this node owns ``address`` (a TCP socket can bind it): where a store may run."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(address) if family == socket.AF_INET else address, 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _own_store():
    """Clear TORCHELASTIC_USE_AGENT_STORE so the rendezvous hosts (rank 0) its own store."""
    with _ENV_LOCK:
        saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


@dataclass
class UpdateGroup:
    """A rank's handle on the weight-update group: broadcast from rank 0, then close."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    pg: object

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        """Broadcast ``tensor`` in place from rank 0 of the group. Blocking; with
        ``async_op`` it returns the work to ``wait()`` on (``tensor`` must stay untouched
        until then)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with virtual_cuda.host_collective() if self.backend == "gloo" else contextlib.nullcontext():
            work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    async def abroadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast each of ``tensors`` in turn from rank 0, awaited on an event loop: the
        loop's thread posts every broadcast at once (no hop to a worker thread before the
        sender may start, no wait between two tensors) and is woken when all completed; a
        failed broadcast raises here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(fut) -> None:  # on the loop: the broadcasts' outcome
            if done.cancelled():
                return
            try:
                for one in fut.value():
                    one.value()
                done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting handler
                done.set_exception(exc)

        futures = [self.broadcast(t, async_op=True).get_future() for t in tensors]
        torch.futures.collect_all(futures).add_done_callback(
            lambda fut: loop.call_soon_threadsafe(settle, fut))
        await done

    def close(self) -> None:
        """Destroy the group (as SGLang's destroy_weights_update_group does); peers that are
        still inside a broadcast see the connection close and fail instead of hanging."""
        if self.pg is None:
            return
        try:
            dist.destroy_process_group(self.pg)
        except Exception:  # a peer already left or the group is half-formed; nothing to free
            pass
        self.pg = None


def open_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str = "gloo",
                      timeout_s: float = 300.0) -> UpdateGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group; blocks until all ranks join."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world, rendezvous)

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: the weight-update group supports gloo or nccl")
    if not group_name:
        raise ValueError("group_name must be non-empty (SGLang asserts it)")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    with _own_store():
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(master_port)}", rank,
                                                  world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                      PrefixStore(group_name, store), group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return UpdateGroup(group_name, rank, world_size, backend, pg)
