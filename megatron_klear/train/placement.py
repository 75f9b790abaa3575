"""Where the rollout engines run beside the trainer, behind one interface the RL loop calls.

:class:`SeparatePlacement`: the engines have GPUs of their own (or are given by
``--rollout-urls``); weights go over the bucketed weight-update group (rollout/transport/weight_sync.py).
:class:`ColocatedPlacement` (``--colocate``): trainer and engines take turns on the same GPUs
(:class:`~megatron_klear.train.colocate.Colocation`), weights go as tensor handles
(rollout/transport/tensor_sync.py). The loop calls, in order: :meth:`Placement.start` (the engines
take the trainer's first weights), per step :meth:`~Placement.before_train` and
:meth:`~Placement.sync_and_probe` (with the probe of rollout/transport/probe.py), around a save
:meth:`~Placement.trainer_resident`, and :meth:`~Placement.close`. A new placement is a
subclass here and a branch in :func:`build_placement`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import time
from typing import Any, ContextManager, Iterator

import torch

from megatron_klear.rollout.transport.probe import probe_after_sync
from megatron_klear.train.colocate import ENGINE_MEMORY, Colocation
from megatron_klear.train.engine import Engine
from megatron_klear.train.rl_config import INFLIGHT_PAUSE_MODES, RLConfig, async_share
from megatron_klear.train.rl_data import broadcast_batch

__all__ = ["Placement", "SeparatePlacement", "ColocatedPlacement", "build_placement",
           "rollout_servers"]


class Placement(abc.ABC):
    """The hand-overs between the trainer and the rollout engines (collective calls)."""

    def __init__(self, engine: Engine, sync: Any) -> None:
        self.engine, self.sync = engine, sync

    @abc.abstractmethod
    def start(self, version: str) -> None:
        """Join the weight-update group; the engines take the trainer's weights (``version``)."""

    def before_train(self) -> dict[str, float]:
        """Make the trainer ready to train (after the rollout); its metrics."""
        return {}

    @abc.abstractmethod
    def sync_and_probe(self, version: str, probe: bool) -> dict[str, float]:
        """Send the trained weights as ``version`` (and with ``probe``, check them: the
        steps :meth:`RLConfig.probe_due` names); the engines generate next."""

    def trainer_resident(self) -> ContextManager[None]:
        """The trainer's state on the device for the block (a checkpoint save)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Leave the weight-update group; the trainer keeps its state (export)."""
        self.sync.close()


class SeparatePlacement(Placement):
    """Engines on devices of their own: the trainer stays resident."""

    def start(self, version: str) -> None:
        self.sync.connect()
        self.sync.sync(weight_version=version)

    def sync_and_probe(self, version: str, probe: bool) -> dict[str, float]:
        self.engine.gather_params()  # the distributed optimizer may defer the all-gather
        metrics = dict(self.sync.sync(weight_version=version))
        if probe:
            t0 = time.time()
            metrics.update(probe_after_sync(self.sync, self.engine))
            metrics["time/probe_s"] = time.time() - t0
        return metrics


class ColocatedPlacement(Placement):
    """Trainer and engines on the same devices, taking turns (train/colocate.py)."""

    def __init__(self, engine: Engine, sync: Any, colocation: Colocation) -> None:
        super().__init__(engine, sync)
        self.colocation = colocation

    def start(self, version: str) -> None:
        self.sync.connect()
        self.colocation.release_engines()  # so the first sync resumes them as every later one
        self.colocation.sync_and_probe(self.sync, version, probe=False)

    def before_train(self) -> dict[str, float]:
        return self.colocation.before_train()

    def sync_and_probe(self, version: str, probe: bool) -> dict[str, float]:
        return self.colocation.sync_and_probe(self.sync, version, probe)

    def trainer_resident(self) -> ContextManager[None]:
        return self.colocation.trainer_resident()

    def close(self) -> None:
        super().close()
        self.colocation.close()


def build_placement(cfg: RLConfig, urls: list[str], engine: Engine, client: Any) -> Placement:
    """The run's placement over the servers at ``urls`` (``client``: a RolloutClient of
    them)."""
    if cfg.colocate:
        from megatron_klear.rollout.transport.tensor_sync import TensorWeightSync

        sync = TensorWeightSync(urls, engine.model, engine.arch, rollout_client=client,
                                bucket_bytes=cfg.weight_sync_bucket_mb * 2**20)
        # engines this run started hold their memory; given ones were released by their
        # launch script or, told they were just launched, by train() before the model's build
        state = ENGINE_MEMORY["released" if cfg.rollout_urls else "launched"]
        colocation = Colocation(engine, client if torch.distributed.get_rank() == 0 else None,
                                state)
        return ColocatedPlacement(engine, sync, colocation)
    from megatron_klear.rollout.transport.weight_sync import WeightSync

    # synchronous runs have nothing in flight at a sync: abort + flush is the clean state
    sync = WeightSync(urls, engine.model, engine.arch,
                      bucket_bytes=cfg.weight_sync_bucket_mb * 2**20,
                      load_format=None if cfg.weight_sync_format == "per_tensor"
                      else cfg.weight_sync_format,
                      master_addr=cfg.weight_sync_master_addr, rollout_client=client,
                      pause_mode=INFLIGHT_PAUSE_MODES[cfg.async_inflight]
                      if cfg.async_rollout else "abort",
                      flush_cache=not cfg.async_rollout)
    return SeparatePlacement(engine, sync)


@contextlib.contextmanager
def rollout_servers(cfg: RLConfig) -> Iterator[Any]:
    """The rollout servers of the run: given URLs, or embedded servers started here (rank 0;
    with ``--colocate`` one per ``--sglang-tp-size`` ranks)."""
    from megatron_klear.rollout.engine.launcher import connect, embedded_server_layout, \
        launch_embedded_servers

    if cfg.rollout_urls:
        yield connect(cfg.rollout_urls)
    elif torch.distributed.get_rank() == 0:
        count, threads = embedded_server_layout(
            max(torch.distributed.get_world_size() // cfg.sglang_tp_size, 1)
            if cfg.colocate else cfg.rollout_num_servers,  # colocated: one per engine TP group
            async_share(len(os.sched_getaffinity(0))) if cfg.async_rollout else None)
        with launch_embedded_servers(cfg.hf_checkpoint, count, seed=cfg.seed, num_threads=threads,
                                     return_routed_experts=cfg.use_routing_replay,
                                     batch_invariant=cfg.deterministic_rollout,
                                     on_policy=cfg.true_on_policy_mode) as servers:
            broadcast_batch(servers.urls)
            yield servers
    else:
        yield connect(broadcast_batch(None))
