"""A frozen policy beside the trained one: where its weights come from, and the Megatron
teacher of on-policy distillation as a model of its own.

Two frozen policies exist: the KL reference (train/reference.py, ``--ref-load``; the policy's
own architecture, so its weights are swapped into the policy's model chunks) and the teacher
of ``--opd-type megatron`` (``--opd-teacher-load``; any size or architecture whose vocabulary
is the student's, so it is a model of its own, :class:`FrozenModel`). Both read a Megatron
checkpoint or a Hugging Face dir (:func:`load_frozen_weights`), run forward only (no grads,
no optimizer state), and keep their weights in host memory between uses.

The teacher's parameters live in one pinned host arena (train/offload.py's
:class:`~megatron_klear.train.offload.TrainerOffload`, ``params`` group) and come onto the
device only inside :meth:`FrozenModel.resident`: one host->device copy of the rank's teacher
shards per use; leaving frees the device copies without copying back (the weights never
change).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_klear.config import ConfigError, TrainConfig

__all__ = ["is_hf_dir", "source_hf_config", "source_tokenizer", "load_frozen_weights",
           "FrozenModel"]


def is_hf_dir(source: str | Path) -> bool:
    """True for a Hugging Face model dir (config.json and *.safetensors)."""
    return (Path(source) / "config.json").is_file() and any(Path(source).glob("*.safetensors"))


def source_hf_config(source: str | Path, flag: str) -> dict:
    """The config.json of a frozen policy's ``source``: an HF dir's own, or the one a Megatron
    checkpoint records (``klear_meta.json``); ConfigError naming ``flag`` for anything else."""
    from megatron_klear.checkpoint.state import find_latest_checkpoint, read_meta
    from megatron_klear.models.qwen3 import load_hf_config

    if is_hf_dir(source):
        return load_hf_config(source)
    path = find_latest_checkpoint(source) if Path(source).is_dir() else None
    if path is None:
        raise ConfigError(f"{flag} {source}: neither a Hugging Face model dir (config.json + "
                          "*.safetensors) nor a Megatron checkpoint dir (iter_*/klear_meta.json); "
                          "pass one (tools/convert_hf_to_megatron.py makes a checkpoint)")
    hf_config = read_meta(path).get("hf_config")
    if not hf_config:
        raise ConfigError(f"{flag} {source}: the checkpoint {path.name} records no hf_config, so "
                          "its architecture is unknown; convert the model again with this "
                          "version (tools/convert_hf_to_megatron.py)")
    return hf_config


def source_tokenizer(source: str | Path) -> str | None:
    """The tokenizer dir a frozen policy's ``source`` records, if any: an HF dir holding
    tokenizer files; a trainer's checkpoint, the ``--hf-checkpoint`` of the run that saved it
    (its saved config). None when neither says."""
    from megatron.core import dist_checkpointing

    from megatron_klear.checkpoint.state import find_latest_checkpoint

    if is_hf_dir(source):
        found = any((Path(source) / f).is_file() for f in ("tokenizer.json",
                                                            "tokenizer_config.json"))
        return str(source) if found else None
    path = find_latest_checkpoint(source)
    if path is None:
        return None
    common = dist_checkpointing.load_common_state_dict(str(path))
    return ((common.get("extra") or {}).get("config") or {}).get("hf_checkpoint")


def load_frozen_weights(model: list[torch.nn.Module], arch: Any, source: str, flag: str) -> None:
    """Load ``source`` (an HF dir, or a Megatron checkpoint's newest iteration, resharded to
    this layout) into ``model``'s chunks (collective over the ranks); CheckpointError naming
    ``flag`` when it is neither."""
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.hf_io import SafetensorsReader
    from megatron_klear.checkpoint.state import CheckpointError, load_checkpoint

    if is_hf_dir(source):
        load_hf_weights(model, arch, SafetensorsReader(source))
    elif load_checkpoint(source, model, load_rng=False, hf_config=arch.hf_config) is None:
        raise CheckpointError(f"{flag} {source}: neither a Hugging Face model dir "
                              "(config.json + *.safetensors) nor a checkpoint dir")


class FrozenModel:
    """A second Qwen3 model read from ``source`` at ``cfg``'s parallel layout (TP, PP, CP, EP;
    its own layers and widths), forward only, its weights in host memory between uses.

    ``engine``: an :class:`~megatron_klear.train.engine.Engine` without DDP or optimizer, so
    the trainer's forward-only schedule (``algo.rl_objective.old_logprobs``) runs it as it runs
    the policy. No LoRA adapters: the frozen model is whole."""

    def __init__(self, cfg: TrainConfig, source: str, flag: str) -> None:
        from megatron_klear.models.qwen3 import build_model_chunks, qwen3_config_from_hf
        from megatron_klear.train.engine import Engine
        from megatron_klear.train.offload import TrainerOffload

        arch = qwen3_config_from_hf(source_hf_config(source, flag))
        model = build_model_chunks(arch, cfg)
        for chunk in model:
            chunk.requires_grad_(False)
        load_frozen_weights(model, arch, source, flag)
        self.engine = Engine(cfg=cfg, arch=arch, model=model)
        self._offload = TrainerOffload(model, None)
        self._offload.offload("params")

    @property
    def nbytes(self) -> int:
        """This rank's bytes of frozen weights (host memory; device memory while resident)."""
        return self._offload.nbytes

    @contextlib.contextmanager
    def resident(self) -> Iterator[Any]:
        """The weights on the device inside the block (yields the engine); freed after."""
        self._offload.onload()
        try:
            yield self.engine
        finally:
            self._offload.offload("params", unchanged=True)
