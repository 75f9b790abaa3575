"""The weight-sync probe: after a sync, do the rollout engines hold the trainer's weights?

klear-rl probes the first sync of a run (or of a resume) and every ``--probe-interval``-th
step's (RLConfig.probe_due).

The trainer and every engine compute the log-probs of one fixed token sequence
(:func:`probe_ids`); the max |engine - trainer| (``weight_sync/probe_max_abs_diff``) is near 0
when the sync was exact, and the trainer's mean log-prob moves when the weights move. Both
placements use this module: the separate one asks the servers and computes the trainer's side
meanwhile (:func:`probe_after_sync`); the colocated one (train/colocate.py) takes the trainer's
side before it offloads its parameters and asks the engines once they have resumed.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_klear import platform

if TYPE_CHECKING:
    from megatron_klear.rollout.transport.weight_sync import WeightSync

__all__ = ["PROBE_METRIC", "probe_ids", "probe_asker", "probe_computes",
           "trainer_sequence_logprobs",
           "probe_metrics", "probe_after_sync"]

PROBE_METRIC = "weight_sync/probe_max_abs_diff"


def trainer_sequence_logprobs(model: torch.nn.Module | list[torch.nn.Module], arch,
                              input_ids: list[int]) -> torch.Tensor | None:
    """The trainer's fp32 logprobs of tokens 1..L-1 of ``input_ids`` (last PP stage; else None).

    Collective over the model-parallel group (runs megatron's forward-only schedule).
    """
    from megatron_klear.checkpoint.convert import megatron_logits

    ids = torch.tensor([input_ids], dtype=torch.long, device=platform.device())
    logits = megatron_logits(model, arch, ids)
    if logits is None:
        return None
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    return logp.gather(1, ids[0, 1:, None])[:, 0]


def probe_ids(arch) -> list[int]:
    """The probe's fixed token sequence: ids 1..32 (fewer in a smaller vocabulary)."""
    return list(range(1, min(arch.vocab_size, 33)))


def probe_asker() -> bool:
    """Whether this rank asks the servers for the probe: the one that holds the trainer's
    logprobs (last PP stage) in TP rank 0 of data-parallel replica 0."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0)


def probe_computes() -> bool:
    """Whether this rank computes the trainer's side of the probe: the model-parallel ranks
    of data-parallel replica 0, where the asker is (:func:`probe_asker`); the other
    replicas' forward would be thrown away while it takes cores from the servers answering
    the probe. With expert parallelism every rank runs it (its all-to-alls span replicas)."""
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_rank() == 0
            or ps.get_expert_model_parallel_world_size() > 1)


def probe_metrics(sync: "WeightSync", input_ids: list[int],
                  trainer_logprobs: torch.Tensor | None,
                  pending: concurrent.futures.Future | None) -> dict[str, float]:
    """Collective: the probe's metrics on every rank. The asking rank (:func:`probe_asker`,
    whose ``pending`` is its :meth:`WeightSync.request_probe`) compares the servers' logprobs
    with ``trainer_logprobs`` and shares the max |difference| and the trainer's mean logprob
    (which moves when the weights move)."""
    answer = None
    if pending is not None:
        answer = (sync.probe(input_ids, trainer_logprobs, pending.result()),
                  float(trainer_logprobs.mean()))
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, answer)
    diff, mean_lp = next(a for a in held if a is not None)
    return {PROBE_METRIC: diff, "weight_sync/probe_logprob_mean": mean_lp}


def probe_after_sync(sync: "WeightSync", engine: Any) -> dict[str, float]:
    """Collective: the probe right after ``sync`` sent the trainer's (resident) weights: the
    asking rank starts the servers on it, the trainer computes its side meanwhile."""
    ids = probe_ids(engine.arch)
    pending = sync.request_probe(ids) if probe_asker() else None  # servers work meanwhile
    trainer_lp = trainer_sequence_logprobs(engine.model, engine.arch, ids) \
        if probe_computes() else None
    return probe_metrics(sync, ids, trainer_lp, pending)
