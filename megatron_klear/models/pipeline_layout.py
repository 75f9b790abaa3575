"""Pipeline layouts: how many decoder layers each pipeline stage and virtual chunk builds.

One home for the layer split of ``--pipeline-model-parallel-size`` with the uneven-stage
flags (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``)
and interleaving (``--num-layers-per-virtual-pipeline-stage``). :class:`PipelineLayout`
validates them against the model's layer count with errors that name the flags, and
turns them into megatron-core's TransformerConfig fields; megatron-core then builds each
stage's layers with their global ``layer_number`` (which the HF bridge, weight sync and
checkpoints use), so nothing else needs to know the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_klear.config import ConfigError, TrainConfig

__all__ = ["PipelineLayout"]

_FIRST = "--decoder-first-pipeline-num-layers"
_LAST = "--decoder-last-pipeline-num-layers"
_VPP = "--num-layers-per-virtual-pipeline-stage"
_PP = "--pipeline-model-parallel-size"


@dataclass(frozen=True)
class PipelineLayout:
    """The decoder-layer split of a model over pipeline stages (validated on creation)."""

    num_layers: int
    pp: int = 1
    first: int | None = None
    last: int | None = None
    layers_per_virtual_stage: int | None = None

    @classmethod
    def from_config(cls, num_layers: int, cfg: TrainConfig) -> "PipelineLayout":
        """The layout of a TrainConfig's pipeline flags for a model of ``num_layers``."""
        return cls(num_layers, cfg.pipeline_model_parallel_size,
                   cfg.decoder_first_pipeline_num_layers, cfg.decoder_last_pipeline_num_layers,
                   cfg.num_layers_per_virtual_pipeline_stage)

    def __post_init__(self) -> None:
        self._check_uneven()
        self._check_virtual()

    def _check_uneven(self) -> None:
        n, pp = self.num_layers, self.pp
        for name, value in ((_FIRST, self.first), (_LAST, self.last)):
            if value is not None and pp < 2:
                raise ConfigError(f"{name} needs {_PP} > 1 (it sizes one pipeline stage)")
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.first is None and self.last is None:
            if n % pp:
                raise ConfigError(f"{_PP} {pp} does not divide num_hidden_layers={n}; set "
                                  f"{_FIRST} and/or {_LAST} for uneven stages")
            return
        middle = pp - (self.first is not None) - (self.last is not None)
        rest = n - (self.first or 0) - (self.last or 0)
        given = " + ".join(f"{name} {v}" for name, v in ((_FIRST, self.first),
                                                         (_LAST, self.last)) if v is not None)
        if middle == 0 and rest != 0:
            raise ConfigError(f"{given} = {n - rest} must equal num_hidden_layers={n} at "
                              f"{_PP} {pp} (no middle stages)")
        if middle and (rest < middle or rest % middle):
            raise ConfigError(f"with {given}, {rest} of num_hidden_layers={n} remain for the "
                              f"{middle} other pipeline stage(s) of {_PP} {pp}; they must split "
                              "evenly with at least one layer per stage")

    def _check_virtual(self) -> None:
        v = self.layers_per_virtual_stage
        if v is None:
            return
        if v < 1:
            raise ConfigError(f"{_VPP} must be >= 1, got {v}")
        if self.pp < 2:
            raise ConfigError(f"{_VPP} needs {_PP} > 1 (interleaving splits pipeline stages)")
        if self.first is not None or self.last is not None:
            raise ConfigError(f"{_VPP} cannot be combined with {_FIRST} / {_LAST}; use even "
                              "stages for interleaving")
        per_stage = self.num_layers // self.pp
        if per_stage % v or per_stage // v < 2:
            raise ConfigError(f"{_VPP} {v} must divide the {per_stage} layers per pipeline "
                              f"stage into at least 2 model chunks")

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage, first to last."""
        if self.first is None and self.last is None:
            return (self.num_layers // self.pp,) * self.pp
        middle = self.pp - (self.first is not None) - (self.last is not None)
        rest = self.num_layers - (self.first or 0) - (self.last or 0)
        inner = (rest // middle,) * middle if middle else ()
        return ((self.first,) if self.first is not None else ()) + inner + \
            ((self.last,) if self.last is not None else ())

    @property
    def virtual_size(self) -> int | None:
        """Model chunks per pipeline rank (megatron's virtual_pipeline_model_parallel_size),
        None without interleaving."""
        if self.layers_per_virtual_stage is None:
            return None
        return self.num_layers // self.pp // self.layers_per_virtual_stage

    @property
    def num_model_chunks(self) -> int:
        """Model chunks each rank holds (1 without interleaving)."""
        return self.virtual_size or 1

    def transformer_config_fields(self) -> dict[str, Any]:
        """megatron-core TransformerConfig fields of this layout."""
        return dict(pipeline_model_parallel_size=self.pp,
                    num_layers_in_first_pipeline_stage=self.first,
                    num_layers_in_last_pipeline_stage=self.last,
                    virtual_pipeline_model_parallel_size=self.virtual_size)
