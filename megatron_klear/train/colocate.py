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

A checkpoint save (:meth:`Colocation.trainer_resident`) releases the engines' KV cache, brings
the trainer back, saves, offloads it and resumes the KV cache; the run's end
(:meth:`Colocation.close`) releases the KV cache for good before the trainer comes back for
the HF export. The engines' weights stay through both (8B plan, docs/memory.md: the save
phase holds the trainer's state and the engines' weights, not their 60 GiB of KV cache).

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

__all__ = ["Colocation", "RELEASE_ORDER", "LAUNCH_RELEASED", "engine_memory_state"]

RELEASE_ORDER = ("kv_cache", "weights")  # SGLang's tags, in the order the engines free them
# What a colocated run is handed by a launch script (run_rl_colocate.sh, tests/gpu/): SGLang
# engines released (KV cache and weights) so that the trainer's model fits while it is built.
# SGLang 0.5.23 cannot be asked (its offload_tags stay inside the scheduler,
# sglang/srt/managers/scheduler_components/weight_updater.py); the embedded server answers.
LAUNCH_RELEASED = ("kv_cache", "weights")


def engine_memory_state(client) -> set[str]:
    """The tags the engines have released now: what each reports in ``/server_info``
    (``memory_released``, the embedded server), else :data:`LAUNCH_RELEASED`. Engines that
    disagree are refused: the hand-overs release and resume them together."""
    states = {}
    for url, info in client.server_info().items():
        info = info if isinstance(info, dict) else {}
        states[url] = frozenset(info.get("memory_released", LAUNCH_RELEASED))
    if len(set(states.values())) > 1:
        raise RuntimeError("the colocated engines hold different memory: "
                           + ", ".join(f"{u} released {sorted(t)}" for u, t in states.items())
                           + "; start them alike (run_rl_colocate.sh releases kv_cache and "
                           "weights of every engine)")
    return set(next(iter(states.values()), ()))


class Colocation:
    """The hand-overs of a colocated run (collective over the trainer ranks; rank 0 talks to
    the engines). ``client``: a RolloutClient of the engines (rank 0; None elsewhere).

    The engines' memory is known at every moment (:attr:`released`, asked or assumed at the
    start, then tracked): a tag is released only while held and resumed only while released,
    since SGLang with ``--enable-memory-saver`` ends the engine otherwise. The trainer's
    peak device bytes of each phase are measured (``torch.cuda.max_memory_allocated``; the
    strict virtual-CUDA mode counts them on CPU) and reported as
    ``memory/trainer_<phase>_peak_gib``."""

    def __init__(self, engine, client: Any | None) -> None:
        self.engine, self.client = engine, client
        self.offload = TrainerOffload(engine.model, engine.optimizer)
        held = [sorted(engine_memory_state(client)) if dist.get_rank() == 0 else None]
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
                    "twice or resumed while held: engines given by --rollout-urls must come "
                    f"released ({list(LAUNCH_RELEASED)}) as run_rl_colocate.sh leaves them, "
                    "unless their /server_info reports memory_released") from exc
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
        """The engines release what they hold of KV cache, then weights (nothing twice)."""
        self._release(RELEASE_ORDER)

    def before_train(self) -> dict[str, float]:
        """Steps 2-3: engines release KV cache then weights; the trainer comes back."""
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
        self._resume(("kv_cache",))
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
        self._release(("kv_cache",))
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
                self._resume(("kv_cache",))

    def close(self) -> None:
        """Bring the trainer back (export, checkpoints after the loop) with the engines' KV
        cache released (they serve no more rollouts; their weights stay)."""
        self._release(("kv_cache",))
        if self.offload.offloaded:
            self.offload.onload()
