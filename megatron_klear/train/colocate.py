"""Colocated RL (``klear-rl --colocate``): trainer and rollout engines take turns on the same
GPUs, handing memory back and forth through SGLang's release/resume endpoints and
:class:`~megatron_klear.train.offload.TrainerOffload`.

A step (issue 31), each hand-over a barrier over the trainer ranks so that no side allocates
before the other has freed:

1. rollout (the trainer is offloaded: the engines hold weights and KV cache);
2. the engines release their memory, KV cache then weights (``/release_memory_occupation``);
3. the trainer's parameters, gradients and optimizer state come back (onload);
4. the training step; the trainer's log-probs of the probe sequence are taken now, with the
   weights about to be sent (the probe compares the engines against them after step 8);
5. the trainer offloads its gradients and optimizer state;
6. the engines resume their weights (``/resume_memory_occupation``, tag ``weights``);
7. the weights go over as tensor handles (:class:`TensorWeightSync`), from the parameters,
   which are offloaded right after: the parameters leave last, since the sync reads them;
8. the engines resume their KV cache; the probe asks them.

The GPU part (CUDA IPC handles, torch_memory_saver in SGLang, memory handed to the driver)
is not run on a GPU; on CPU every step runs against the embedded servers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_klear.train.offload import TrainerOffload

__all__ = ["Colocation", "RELEASE_ORDER"]

RELEASE_ORDER = ("kv_cache", "weights")  # SGLang's tags, in the order the engines free them


class Colocation:
    """The hand-overs of a colocated run (collective over the trainer ranks; rank 0 talks to
    the engines). ``client``: a RolloutClient of the engines (rank 0; None elsewhere)."""

    def __init__(self, engine, client: Any | None) -> None:
        self.engine, self.client = engine, client
        self.offload = TrainerOffload(engine.model, engine.optimizer)
        self.released: list[str] = []  # engine tags released now

    def _engines(self, path: str, tags: list[str]) -> None:
        """Rank 0 posts ``path`` with ``tags`` to every engine; then all ranks pass a barrier."""
        if dist.get_rank() == 0:
            self.client.post_all(path, {"tags": tags})
        dist.barrier()

    def release_engines(self) -> None:
        """The engines release KV cache, then weights. Called before the first sync too, so
        that it resumes their weights and KV cache as every later one does. Releasing
        is idempotent on the embedded server; an engine a launch script released already
        (run_rl_colocate.sh does, so that the trainer's model fits while it is built) gets
        the same request again (SGLang: not run on a GPU)."""
        for tag in RELEASE_ORDER:
            self._engines("/release_memory_occupation", [tag])
            self.released.append(tag)

    def before_train(self) -> dict[str, float]:
        """Steps 2-3: engines release KV cache then weights; the trainer comes back."""
        t0 = time.perf_counter()
        self.release_engines()
        t1 = time.perf_counter()
        self.offload.onload()
        return {"time/engine_release_s": t1 - t0,
                "time/trainer_onload_s": time.perf_counter() - t1}

    def sync_and_probe(self, sync, version: str, probe: bool) -> dict[str, float]:
        """Steps 4 (probe log-probs) to 8 after a training step (or at the start of the run,
        with nothing released): sync the weights by handle with the trainer offloaded around
        them; the probe's max |engine - trainer| log-prob as in the separate mode."""
        from megatron_klear.rollout.probe import probe_asker, probe_ids, probe_metrics, \
            trainer_sequence_logprobs

        metrics: dict[str, float] = {}
        if self.offload.offloaded:  # a skipped step (nothing trained): the turn is taken anyway
            metrics.update(self.before_train())
        self.engine.gather_params()  # the distributed optimizer may defer the all-gather
        ids = probe_ids(self.engine.arch)
        trainer_lp = trainer_sequence_logprobs(self.engine.model, self.engine.arch, ids) \
            if probe else None
        t0 = time.perf_counter()
        self.offload.offload("state")
        if "weights" in self.released:
            self._engines("/resume_memory_occupation", ["weights"])
            self.released.remove("weights")
        t1 = time.perf_counter()
        metrics.update(sync.sync(weight_version=version))
        t2 = time.perf_counter()
        self.offload.offload("params")
        if "kv_cache" in self.released:
            self._engines("/resume_memory_occupation", ["kv_cache"])
            self.released.remove("kv_cache")
        metrics.update({"time/colocate_before_sync_s": t1 - t0,
                        "time/colocate_after_sync_s": time.perf_counter() - t2,
                        "colocate/offloaded_bytes": float(self.offload.nbytes)})
        if probe:  # the trainer's logprobs came before its offload, the engines' come now
            metrics.update(probe_metrics(sync, ids, trainer_lp,
                                         sync.request_probe(ids) if probe_asker() else None))
        return metrics

    @contextlib.contextmanager
    def trainer_resident(self) -> Iterator[None]:
        """The trainer's state on the device for the block (a checkpoint save), as it was
        after."""
        was = self.offload.offloaded
        if was:
            self.offload.onload()
        try:
            yield
        finally:
            if was:
                self.offload.offload()

    def close(self) -> None:
        """Bring the trainer back (export, checkpoints after the loop)."""
        if self.offload.offloaded:
            self.offload.onload()
