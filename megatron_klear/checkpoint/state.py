"""Training-state checkpoints shared by every trainer and by the HF -> Megatron converter.

On-disk layout (Megatron-LM-like)::

    <dir>/iter_0000010/                 megatron dist_checkpointing ``torch_dist`` save of
                                        {"model" | "model0", "model1", ..., "optimizer",
                                         "opt_param_scheduler", "extra"}
    <dir>/iter_0000010/rng/rank_00000.pt  per-rank RNG states (python, numpy, torch, tracker)
    <dir>/iter_0000010/klear_meta.json  written LAST: iteration, tp, pp, world size, dtype,
                                        hf_config, trainer (sft, rl, convert), contents,
                                        file sizes, complete: true
    <dir>/latest_checkpointed_iteration.txt

A save goes into ``<dir>/.iter_0000010.tmp``, is fsynced, then renamed into place, and only
then the ``latest`` marker is replaced (atomically). A checkpoint without a valid
``klear_meta.json`` or whose files do not match the sizes recorded there is partial or
corrupt: :func:`find_latest_checkpoint` skips it with a warning.

Resharding: model weights load at any TP/PP layout (dist_checkpointing reshards them).
The non-distributed megatron optimizer (the CPU default) stores its Adam moments as
ShardedTensors keyed like the parameters plus one common step, so it reshards too; the
distributed optimizer saves the same canonical per-parameter layout
(:data:`OPTIMIZER_METADATA`). RNG states are restored only when the
layout (TP, PP, world size) is unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_klear.checkpoint.hf_bridge import unwrap_model
from megatron_klear.models.lora import has_lora, is_adapter_key
from megatron_klear.models.qwen3 import qwen3_config_from_hf
from megatron_klear.orphans import forks_die_with_parent

__all__ = ["CheckpointInfo", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "find_latest_checkpoint", "read_meta", "iteration_dir", "check_same_model",
           "FORMAT_VERSION", "META_FILE", "LATEST_FILE", "ARCH_FIELDS"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "klear_meta.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# The distributed optimizer saves its state in the canonical per-parameter layout (gathered
# over DP), which reshards to any TP/PP/DP; megatron-core 0.16.1's default
# (fully_sharded_model_space) uses flattened ranges that its dist_checkpointing rejects.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# The Qwen3Arch facts that fix the saved tensors' shapes, by their config.json names: a
# checkpoint loads only into a model that agrees on all of them.
ARCH_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
               "ffn_hidden_size": "intermediate_size", "num_attention_heads":
               "num_attention_heads", "num_query_groups": "num_key_value_heads",
               "head_dim": "head_dim", "vocab_size": "vocab_size",
               "tie_word_embeddings": "tie_word_embeddings", "num_experts": "num_experts",
               "moe_ffn_hidden_size": "moe_intermediate_size", "moe_layers": "sparse layers"}


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names the path."""


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` restored."""

    iteration: int
    extra: dict = field(default_factory=dict)
    path: Path | None = None
    hf_config: dict | None = None
    optimizer_restored: bool = False
    trainer: str | None = None  # who wrote it: sft, rl, convert (None: before it was recorded)


def iteration_dir(save_dir: str | Path, iteration: int) -> Path:
    """``<save_dir>/iter_0000010`` for iteration 10."""
    return Path(save_dir) / f"iter_{iteration:07d}"


# ---------------------------------------------------------------- small helpers
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"tp": 1, "pp": 1, "world_size": _world()}
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "world_size": _world()}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temp file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != META_FILE}


def _model_keys(n_chunks: int) -> list[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _model_sharded_state_dict(model_chunks: list[torch.nn.Module], part: str = "all") -> dict:
    """Each chunk's sharded state dict: ``all`` of it, only the LoRA ``adapters`` or only the
    ``base`` (everything but the adapters)."""
    keep = {"all": lambda k: True, "adapters": is_adapter_key,
            "base": lambda k: not is_adapter_key(k)}[part]
    return {key: {k: v for k, v in unwrap_model(chunk).sharded_state_dict().items() if keep(k)}
            for key, chunk in zip(_model_keys(len(model_chunks)), model_chunks)}


def _has_tensors(sharded: dict) -> bool:
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return any(isinstance(v, ShardedTensor) for v in nested_values(sharded))


# ---------------------------------------------------------------- RNG
def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------- save
def _orphan_safe_writer_queue() -> None:
    """Start megatron's checkpoint-writer results queue in a manager process that exits with
    this one.

    megatron-core's ``filesystem_async._get_write_results_queue`` lazily starts a spawn
    ``Manager()`` server that nothing stops when the trainer is SIGKILLed (it outlived killed
    trainers by 10+ minutes at ~410 MB each). Creating the queue first, with a manager whose
    initializer watches for the parent's death, keeps megatron's writer unchanged.
    """
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_klear.orphans import exit_when_orphaned

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        with _main_module_hidden():
            manager.start(initializer=exit_when_orphaned)
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


@contextlib.contextmanager
def _main_module_hidden():
    """Start spawned processes without re-importing ``__main__`` in them.

    A spawned child imports the parent's main module first; in a trainer that is
    ``megatron_klear.train.sft``/``rl`` (torch + megatron-core, ~6 CPU seconds per rank at
    the first save, measured 10.6 s vs 0.6 s wall on a busy 2-core host). The writer queue's
    manager needs nothing from it, so multiprocessing is shown a main module without
    ``__spec__`` and ``__file__`` while the child starts.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def save_checkpoint(save_dir: str | Path, iteration: int, model_chunks: list[torch.nn.Module], *,
                    optimizer=None, scheduler=None, extra: dict | None = None,
                    hf_config: dict | None = None, keep_last: int | None = None,
                    sharded_strategy=None, trainer: str | None = None) -> Path:
    """Save model (+ optimizer, scheduler, extra, per-rank RNG) as ``iter_XXXXXXX``.

    Collective over all ranks. Writes into a temp dir next to the final one, fsyncs,
    renames, then updates the ``latest`` marker; keeps the newest ``keep_last`` checkpoints
    when given. The previous checkpoints stay intact if this save dies midway.
    ``sharded_strategy`` replaces megatron's default ``torch_dist`` writer (the converters
    pass one that produces the tensors of a meta-device model while writing; it writes in
    this process, so megatron's writer queue and its manager process are not started).
    ``trainer`` (``sft``, ``rl``, ``convert``) is recorded in the meta: a trainer resumes only
    its own checkpoints and takes the weights alone from the others'.
    """
    from megatron.core import dist_checkpointing

    save_dir = Path(save_dir)
    final = iteration_dir(save_dir, iteration)
    tmp = save_dir / f".{final.name}.tmp"
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    lora = has_lora(model_chunks)  # the base is frozen: a LoRA run saves its adapters only
    state = _model_sharded_state_dict(model_chunks, "adapters" if lora else "all")
    contents = list(state)
    if optimizer is not None:
        opt_state = optimizer.sharded_state_dict(state, metadata=OPTIMIZER_METADATA)
        if _has_tensors(opt_state):  # before the first step Adam has no moments to save
            state["optimizer"] = opt_state
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["extra"] = dict(extra or {})
    contents += [k for k in ("optimizer", "opt_param_scheduler") if k in state]
    if sharded_strategy is None:
        _orphan_safe_writer_queue()
    with forks_die_with_parent():  # megatron's forked writers must not outlive a killed trainer
        dist_checkpointing.save(state, str(tmp), sharded_strategy=sharded_strategy)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        _publish(tmp, final, iteration, model_chunks, contents, hf_config, keep_last, trainer,
                 lora)
    _barrier()
    return final


def _publish(tmp: Path, final: Path, iteration: int, model_chunks: list[torch.nn.Module],
             contents: list[str], hf_config: dict | None, keep_last: int | None,
             trainer: str | None, lora: bool = False) -> None:
    """Rank 0: meta last, fsync, rename into place, move the marker, prune old ones."""
    for path in tmp.rglob("*"):
        if path.is_file():
            _fsync_path(path)
    dtype = next(unwrap_model(model_chunks[0]).parameters()).dtype
    meta = {"format_version": FORMAT_VERSION, "iteration": iteration, **_layout(),
            "num_model_chunks": len(model_chunks), "params_dtype": str(dtype).replace("torch.", ""),
            "contents": contents, "hf_config": hf_config, "trainer": trainer,
            "lora": lora, "files": _file_sizes(tmp),
            "complete": True}
    _write_atomic(tmp / META_FILE, json.dumps(meta, indent=2))
    if final.exists():  # re-saving an iteration: replace it only once the new one is whole
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_path(final.parent)
    _write_atomic(final.parent / LATEST_FILE, f"{iteration}\n")
    if keep_last:
        for old in _iteration_dirs(final.parent)[keep_last:]:
            shutil.rmtree(old)


# ---------------------------------------------------------------- find / meta
def _iteration_dirs(root: Path) -> list[Path]:
    """``iter_*`` directories, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _ITER_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def read_meta(path: str | Path) -> dict:
    """The ``klear_meta.json`` of a checkpoint; :class:`CheckpointError` if partial/corrupt."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: no {META_FILE} (partial checkpoint: the save did not "
                              "finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: corrupt JSON ({exc})") from exc
    if not meta.get("complete") or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: not a complete format-{FORMAT_VERSION} checkpoint")
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            raise CheckpointError(f"{f}: missing or truncated (expected {size} bytes)")
    return meta


def find_latest_checkpoint(load_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``load_dir`` (or ``load_dir`` itself if it is one).

    Partial or corrupt checkpoints, and temp dirs left by a killed save, are skipped with
    a warning.
    """
    load_dir = Path(load_dir)
    if _ITER_RE.match(load_dir.name):
        return load_dir if _usable(load_dir) else None
    for stale in sorted(load_dir.glob(".iter_*.tmp")) if load_dir.is_dir() else []:
        log.warning("skipping %s: temp dir of an interrupted save", stale)
    for path in _iteration_dirs(load_dir):
        if _usable(path):
            return path
    return None


def _usable(path: Path) -> bool:
    try:
        read_meta(path)
        return True
    except CheckpointError as exc:
        log.warning("skipping checkpoint: %s", exc)
        return False


# ---------------------------------------------------------------- load
def _load_part(path: Path, meta: dict, model_chunks: list[torch.nn.Module]) -> str:
    """What a load restores: the adapters of a LoRA checkpoint, the base of a LoRA model
    from a full checkpoint, else everything. A LoRA checkpoint without a LoRA model is
    refused (it holds no base weights)."""
    lora_model = has_lora(model_chunks)
    if meta.get("lora"):
        if not lora_model:
            raise CheckpointError(f"{path}: holds LoRA adapters only (no base weights); load it "
                                  "with the run's --lora-rank/--lora-alpha/--lora-target-modules "
                                  "and the base from --hf-checkpoint, or export merged weights")
        return "adapters"
    return "base" if lora_model else "all"


def check_same_model(path: Path, saved: dict | None, expected: dict | None) -> None:
    """Raise :class:`CheckpointError` naming every architecture field (:data:`ARCH_FIELDS`)
    on which the checkpoint's ``hf_config`` and the model's differ (skipped when either
    side does not record its config)."""
    if not saved or not expected:
        return
    old, new = qwen3_config_from_hf(saved), qwen3_config_from_hf(expected)
    diffs = [f"{name} {getattr(old, k)} (checkpoint) vs {getattr(new, k)} (model)"
             for k, name in ARCH_FIELDS.items() if getattr(old, k) != getattr(new, k)]
    if diffs:
        raise CheckpointError(f"{path}: holds a different model: {'; '.join(diffs)}; pass the "
                              "--hf-checkpoint whose config.json the checkpoint was trained with")


def load_checkpoint(load_dir: str | Path, model_chunks: list[torch.nn.Module], *,
                    optimizer=None, scheduler=None, load_rng: bool = True,
                    hf_config: dict | None = None) -> CheckpointInfo | None:
    """Restore the latest complete checkpoint under ``load_dir``; None when there is none.

    Model weights reshard to the current TP/PP layout; the optimizer (non-distributed)
    and scheduler are restored when given and present in the checkpoint; RNG states only
    when the layout is unchanged. ``hf_config``, the model's config.json, must agree with
    the checkpoint's on the tensor shapes (:func:`check_same_model`). Collective over all
    ranks.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    path = find_latest_checkpoint(load_dir)
    if path is None:
        return None
    meta = read_meta(path)
    check_same_model(path, meta.get("hf_config"), hf_config)
    if meta["num_model_chunks"] != len(model_chunks):
        raise CheckpointError(f"{path}: holds {meta['num_model_chunks']} model chunk(s), the "
                              f"model has {len(model_chunks)}; match "
                              "--num-layers-per-virtual-pipeline-stage to the saved run")
    part = _load_part(path, meta, model_chunks)
    state = _model_sharded_state_dict(model_chunks, part)
    if optimizer is not None and "optimizer" in meta["contents"]:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True,
                                                          metadata=OPTIMIZER_METADATA)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except (CheckpointingException, CheckpointException) as exc:  # shapes no config told apart
        last = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        raise CheckpointError(f"{path}: does not fit the model: {last[0].strip()}") from exc
    for key, chunk in zip(_model_keys(len(model_chunks)), model_chunks):
        # a part (LoRA adapters or base) leaves the other part's keys as they are
        unwrap_model(chunk).load_state_dict(loaded[key], strict=part == "all")
    if "optimizer" in state:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "opt_param_scheduler" in loaded:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if load_rng and {k: meta[k] for k in ("tp", "pp", "world_size")} == _layout() \
            and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return CheckpointInfo(iteration=meta["iteration"], extra=loaded.get("extra", {}) or {},
                          path=path, hf_config=meta.get("hf_config"),
                          optimizer_restored="optimizer" in state, trainer=meta.get("trainer"))
