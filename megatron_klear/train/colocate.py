"""Colocated RL (``klear-rl --colocate``): trainer and rollout engines take turns on the same
GPUs, handing memory back and forth through SGLang's release/resume endpoints and
:class:`~megatron_klear.train.offload.TrainerOffload`.

A step (issue 31), each hand-over a barrier over the trainer ranks so that no side allocates
before the other has freed:

1. rollout (the trainer is offloaded: the engines hold weights and KV cache);
2. the engines release their memory, KV cache, weights, CUDA graphs
   (``/release_memory_occupation``);
3. the trainer's parameters, gradients and optimizer state come back (onload);
4. the training step; the trainer's log-probs of the probe sequence are taken now, with the
   weights about to be sent (the probe compares the engines against them after step 8);
5. the trainer offloads its gradients and optimizer state;
6. the engines resume their weights (``/resume_memory_occupation``, tag ``weights``);
7. the weights go over as tensor handles (:class:`TensorWeightSync`), from the parameters,
   which are offloaded right after: the parameters leave last, since the sync reads them;
8. the engines resume their KV cache and CUDA graphs; the probe asks them.

A checkpoint save (:meth:`Colocation.trainer_resident`) releases the engines' KV cache (and
CUDA graphs), brings the trainer back, saves, offloads it and resumes them; the run's end
(:meth:`Colocation.close`) releases them for good before the trainer comes back for
the HF export. The engines' weights stay through both (8B plan, docs/memory.md: the save
phase holds the trainer's state and the engines' weights, not their 60 GiB of KV cache).

The GPU part (CUDA IPC handles, torch_memory_saver in SGLang, memory handed to the driver)
is not run on a GPU; on CPU every step runs against the embedded servers.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_klear.train.offload import TrainerOffload

__all__ = ["Colocation", "RELEASE_ORDER", "ROLLOUT_TAGS", "ENGINE_MEMORY", "engine_memory_state",
           "release_launched_engines"]

# SGLang's tags, in the order the engines free them: all three, as slime releases them (its
# CUDA graphs' memory too, which torch_memory_saver tags cuda_graph; sglang/srt/constants.py
# GPU_MEMORY_ALL_TYPES), resumed weights first (the sync), then KV cache with CUDA graphs
RELEASE_ORDER = ("kv_cache", "weights", "cuda_graph")
ROLLOUT_TAGS = ("kv_cache", "cuda_graph")  # what rollout needs beyond the weights
# The engines' released tags per --rollout-engine-memory. SGLang 0.5.23 cannot be asked (its
# offload_tags stay inside the scheduler, sglang/srt/managers/scheduler_components/
# weight_updater.py), so the state is given by whoever started the engines, never assumed:
# engines this run starts are "launched"; given ones are as the flag says.
ENGINE_MEMORY = {"launched": (), "released": RELEASE_ORDER}


def release_launched_engines(urls: list[str]) -> None:
    """Engines handed over as launched (``--rollout-engine-memory launched``) release their KV
    cache, then weights, before the trainer builds its model on their GPUs, as slime's
    rollout manager releases its engines right after it starts them. Rank 0 only (``RANK``),
    before the process group forms: the other ranks wait for it in the rendezvous."""
    from megatron_klear.rollout.orchestration.client import RolloutClient

    if int(os.environ.get("RANK", "0")) != 0:
        return
    client = RolloutClient(urls)
    engine_memory_state(client, ENGINE_MEMORY["launched"])
    for tag in RELEASE_ORDER:
        client.post_all("/release_memory_occupation", {"tags": [tag]})


def engine_memory_state(client, released: tuple[str, ...]) -> set[str]:
    """``released`` (the tags the engines were handed over with), checked against what each
    engine reports in ``/server_info`` (``memory_released``: the embedded server; SGLang
    reports nothing). An engine that disagrees is refused: the hand-overs release and resume
    every engine together, and SGLang ends when a tag is released twice or resumed held."""
    for url, info in client.server_info().items():
        got = info.get("memory_released") if isinstance(info, dict) else None
        if got is not None and set(got) != set(released):
            raise RuntimeError(f"{url} has released {sorted(got)}, but the run was told "
                               f"{sorted(released)} (--rollout-engine-memory); start every "
                               "engine alike and say how (launched or released)")
    return set(released)


class Colocation:
    """The hand-overs of a colocated run (collective over the trainer ranks; rank 0 talks to
    the engines). ``client``: a RolloutClient of the engines (rank 0; None elsewhere).

    The engines' memory is known at every moment (:attr:`released`, given at the start --
    ``released``, checked where an engine reports it -- then tracked): a tag is released
    only while held and resumed only while released,
    since SGLang with ``--enable-memory-saver`` ends the engine otherwise. The trainer's
    peak device bytes of each phase are measured (``torch.cuda.max_memory_allocated``; the
    strict virtual-CUDA mode counts them on CPU) and reported as
    ``memory/trainer_<phase>_peak_gib``."""

    def __init__(self, engine, client: Any | None, released: tuple[str, ...]) -> None:
        self.engine, self.client = engine, client
        self.offload = TrainerOffload(engine.model, engine.optimizer)
        held = [sorted(engine_memory_state(client, released)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(held, src=0)
        self.released: set[str] = set(held[0])  # engine tags released now
        self.phase = "rollout"  # what the GPUs do now (its peak is measured until it ends)
        self._peaks: dict[str, float] = {}  # measured, not yet reported
        torch.cuda.reset_peak_memory_stats()

    def _engines(self, path: str, tags: list[str]) -> None:
        """Rank 0 posts ``path`` with ``tags`` to every engine; then all ranks pass a barrier."""
        if dist.get_rank() == 0:
            try:
                self.client.post_all(path, {"tags": tags})
            except Exception as exc:
                raise RuntimeError(
                    f"{path} {tags} failed ({exc}); an engine ends when a tag is released "
                    "twice or resumed while held: engines given by --rollout-urls must be as "
                    "--rollout-engine-memory says (launched or released)") from exc
        dist.barrier()

    def _release(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            if tag not in self.released:
                self._engines("/release_memory_occupation", [tag])
                self.released.add(tag)

    def _resume(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            if tag in self.released:
                self._engines("/resume_memory_occupation", [tag])
                self.released.remove(tag)

    def _enter(self, phase: str) -> dict[str, float]:
        """``phase`` begins; the peaks (GiB) measured and not yet reported, the ending
        phase's included."""
        done, self.phase = self.phase, phase
        key = f"memory/trainer_{done}_peak_gib"  # a phase cut by a save: the larger part
        peak = torch.cuda.max_memory_allocated() / 2**30
        self._peaks[key] = max(self._peaks.get(key, 0.0), peak)
        torch.cuda.reset_peak_memory_stats()
        peaks, self._peaks = self._peaks, {}
        return peaks

    def _note(self, phase: str) -> None:
        """``phase`` begins; the peaks are kept for the next report."""
        self._peaks = self._enter(phase)

    def release_engines(self) -> None:
        """The engines release what they hold of KV cache, weights, CUDA graphs (nothing
        twice)."""
        self._release(RELEASE_ORDER)

    def before_train(self) -> dict[str, float]:
        """Steps 2-3: engines release KV cache, weights, CUDA graphs; the trainer comes back."""
        metrics = self._enter("train")
        t0 = time.perf_counter()
        self.release_engines()
        t1 = time.perf_counter()
        self.offload.onload()
        return {**metrics, "time/engine_release_s": t1 - t0,
                "time/trainer_onload_s": time.perf_counter() - t1}

    def sync_and_probe(self, sync, version: str, probe: bool) -> dict[str, float]:
        """Steps 4 (probe log-probs) to 8 after a training step (or at the start of the run,
        with nothing released): sync the weights by handle with the trainer offloaded around
        them; the probe's max |engine - trainer| log-prob as in the separate mode."""
        from megatron_klear.rollout.transport.probe import probe_asker, probe_computes, probe_ids, \
            probe_metrics, trainer_sequence_logprobs

        metrics: dict[str, float] = {}
        if self.offload.offloaded:  # a skipped step (nothing trained): the turn is taken anyway
            metrics.update(self.before_train())
        metrics.update(self._enter("sync"))
        self.engine.gather_params()  # the distributed optimizer may defer the all-gather
        ids = probe_ids(self.engine.arch)
        trainer_lp = trainer_sequence_logprobs(self.engine.model, self.engine.arch, ids) \
            if probe and probe_computes() else None
        t0 = time.perf_counter()
        self.offload.offload("state")
        self._resume(("weights",))
        t1 = time.perf_counter()
        metrics.update(sync.sync(weight_version=version))
        t2 = time.perf_counter()
        self.offload.offload("params")
        metrics.update(self._enter("rollout"))
        self._resume(ROLLOUT_TAGS)
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
        after. The engines' KV cache -- the bulk of their memory -- is released around it
        (their weights stay: they are the synced ones): the plan's ``save`` phase, whose
        peak is reported with the next step's metrics."""
        was, before = self.offload.offloaded, self.phase
        self._release(ROLLOUT_TAGS)
        self._note("save")
        if was:
            self.offload.onload()
        try:
            yield
        finally:
            if was:
                self.offload.offload()
            self._note(before)
            if before == "rollout":
                self._resume(ROLLOUT_TAGS)

    def close(self) -> None:
        """Bring the trainer back (export, checkpoints after the loop) with the engines' KV
        cache released (they serve no more rollouts; their weights stay)."""
        self._release(ROLLOUT_TAGS)
        if self.offload.offloaded:
            self.offload.onload()
