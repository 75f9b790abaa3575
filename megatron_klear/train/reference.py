"""The frozen reference policy of the KL term, kept in host memory (the other frozen policy,
the Megatron teacher of on-policy distillation, is train/frozen_policy.py's).

Its weights are a CPU copy of this rank's shards of the model (same TP/PP layout), taken once
from ``--ref-load`` (a Megatron checkpoint or a Hugging Face dir; default ``--hf-checkpoint``).
For the reference forward they are swapped into the engine's own model chunks and the policy's
weights are put back afterwards bit for bit, so the reference costs no second model on the
device, only host memory for the weights and two host<->device copies per RL step. Both host
copies (the reference's weights, and the policy's while the reference is swapped in) are
allocated once, pinned where CUDA is (a copy between the GPU and pageable memory is staged
by the driver and blocks): a step reuses them instead of allocating a model's worth of host
memory.

With LoRA (``--lora-rank``) the reference is the frozen base itself: the adapters are switched
off for the reference forward (``models.lora.adapters_disabled``), with no copy at all.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_klear import platform
from megatron_klear.config import ConfigError
from megatron_klear.models.lora import adapters_disabled, has_lora
from megatron_klear.train.frozen_policy import load_frozen_weights

__all__ = ["ReferencePolicy"]


def _params(engine) -> list[torch.Tensor]:
    return [p for chunk in engine.model for p in chunk.parameters()]


class ReferencePolicy:
    """Reference weights for ``engine``'s model, read from ``source``."""

    def __init__(self, engine, source: str) -> None:
        self.engine = engine
        self.lora = has_lora(engine.model)
        if self.lora:
            if getattr(engine.cfg, "ref_load", None):
                raise ConfigError("--ref-load with --lora-rank: the KL reference of a LoRA run "
                                  "is its base with the adapters off; drop --ref-load")
            return
        self._policy = self._host_buffers()  # the policy's weights while swapped out
        self._store(self._policy)
        load_frozen_weights(self.engine.model, self.engine.arch, source, "--ref-load")
        self.weights = self._host_buffers()
        self._store(self.weights)
        self._copy_in(self._policy)

    def _host_buffers(self) -> list[torch.Tensor]:
        """One host tensor per parameter, views of one arena pinned exactly
        (``platform.pinned_buffer``; torch's caching host allocator would round each up to a
        power of two, issue 51), allocated once."""
        params, offsets, end = list(_params(self.engine)), [], 0
        for p in params:
            offsets.append(end)
            end += -(-p.numel() * p.element_size() // 64) * 64
        arena = platform.pinned_buffer(end)
        return [arena[o:o + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                for o, p in zip(offsets, params)]

    def _store(self, out: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for h, p in zip(out, _params(self.engine)):
                h.copy_(p.detach())

    def _copy_in(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(_params(self.engine), weights):
                p.copy_(w, non_blocking=True)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The engine's model holds the reference weights inside the block."""
        if self.lora:
            with adapters_disabled(self.engine.model):
                yield
            return
        self._store(self._policy)
        self._copy_in(self.weights)
        try:
            yield
        finally:
            self._copy_in(self._policy)
