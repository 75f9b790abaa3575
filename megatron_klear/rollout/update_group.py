"""The weight-update process group shared by the trainer (rank 0) and the rollout servers.

Built the way SGLang builds its custom group (``init_custom_process_group``): a TCP store
hosted by rank 0 at ``master_address:master_port``, wrapped in ``PrefixStore(group_name + "/")``,
and a backend process group on it, independent of the trainer's default process group.
gloo on CPU, NCCL on GPU. Both the trainer side (weight_sync.py) and the embedded server use
this one helper, so the two ends cannot disagree on the rendezvous.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["UpdateGroup", "open_update_group", "DTYPES", "parse_dtype"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "uint8": torch.uint8, "int64": torch.int64}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16`` (ValueError names the value)."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang requests use)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class UpdateGroup:
    """A rank's handle on the weight-update group: broadcast from rank 0, then close."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    store: dist.Store
    pg: object

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` in place from rank 0 of the group (blocking)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Release the backend (the store closes with its last reference)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # a peer already left; nothing more to release
                pass
        self.pg = None


def open_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str = "gloo",
                      timeout_s: float = 300.0) -> UpdateGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group; blocks until all ranks join."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: the weight-update group supports gloo or nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:  # pragma: no cover - needs GPUs
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return UpdateGroup(group_name, rank, world_size, backend, store, pg)
