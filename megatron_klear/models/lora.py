"""LoRA adapters on megatron-core's tensor-parallel linear layers (issue 41).

:func:`apply_lora` turns the targeted linear layers of a built Qwen3 ``GPTModel``
(megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear``, or Transformer Engine's
linears) into their LoRA variants (:func:`lora_class`: the same class with the adapters'
forward added, same parameters and checkpoint keys, plus an ``adapter`` submodule) and
freezes every other parameter. Transformer Engine's fused norm + linear (``linear_qkv``,
``linear_fc1`` of the TE spec) takes the residual stream: its adapters get the RMSNorm of it
(recomputed in fp32 from ``layer_norm_weight``). The TE path has not run here (no GPU). The adapters are PEFT's: per HF projection
(``q_proj``, ..., ``down_proj``, the names of :data:`~megatron_klear.config.LORA_TARGETS`) a
matrix ``A`` (r x in) and ``B`` (out x r), output ``scale * B A dropout(x)`` with
``scale = alpha / r``. A fused megatron layer holds one adapter per HF part it fuses
(``linear_qkv``: q, k, v; ``linear_fc1``: gate, up), so its weights are PEFT's exactly; a part
that is not targeted adds zeros.

Tensor parallelism (the base weight's split, see checkpoint/hf_bridge.py):

* column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` replicated, ``B`` split like the
  output rows. ``h = A x`` is the same on every rank; its gradient is summed over TP
  (``copy_to_tensor_model_parallel_region``). Under sequence parallelism ``h`` is computed
  on the rank's tokens and all-gathered (r columns, not h), its gradient reduce-scattered;
  ``A``'s gradient then sums over TP in ``finalize_model_grads`` (``sequence_parallel``).
* row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split like the input columns,
  ``B`` replicated; ``h = A x`` is all-reduced over TP (reduce-scattered over the sequence
  under SP, ``B`` then marked ``sequence_parallel``).

Adapters are stored in the model's parameter dtype, so that megatron's mixed-precision
optimizer keeps their fp32 master weights and Adam state (megatron-core 0.16.1's bf16 optimizer
cannot checkpoint fp32 parameters next to bf16 ones); the branch always computes in fp32 and
adds its output in the base output's dtype. Initialisation is PEFT's (A Kaiming-
uniform, B zero), drawn from a generator seeded by the seed, the global layer and the part,
then split: the same adapters at any TP/PP layout.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                             make_sharded_tensors_for_checkpoint)

from megatron_klear.config import LORA_TARGETS, ConfigError

__all__ = ["LoraSpec", "LoraAdapter", "lora_class", "LAYERS", "apply_lora", "lora_spec", "adapters", "has_lora", "is_adapter_key",
           "merged_weight", "has_adapter", "adapters_disabled", "hf_module"]

ADAPTER = "adapter"  # the submodule name: checkpoint keys ``...linear_qkv.adapter.lora_A.q_proj``


@dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha, dropout and HF target modules of a LoRA run."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    @property
    def scale(self) -> float:
        """PEFT's scaling of the adapters' output: alpha / r."""
        return self.alpha / self.rank


def lora_spec(cfg) -> LoraSpec | None:
    """The :class:`LoraSpec` of a TrainConfig (None without ``--lora-rank``)."""
    if not getattr(cfg, "lora_rank", 0):
        return None
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                    tuple(cfg.lora_target_modules or LORA_TARGETS))


# megatron layer (suffix in a transformer layer) -> (kind, HF parts in fused order)
LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("gate_up", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}


def hf_module(part: str) -> str:
    """The HF module path of a part inside a decoder layer (``self_attn.q_proj``)."""
    return ("self_attn." if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + part


def _part_shapes(arch, kind: str, parts: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Full (out, in) shapes of each HF part of a layer."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv, ffn = arch.num_attention_heads * hd, arch.num_query_groups * hd, arch.ffn_hidden_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
    return {p: shapes[p] for p in parts}


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear layer: ``lora_A[part]``, ``lora_B[part]``
    (this TP rank's shards) for each targeted HF part, in the layer's fused layout."""

    def __init__(self, kind: str, parts: tuple[str, ...], targeted: tuple[str, ...],
                 shapes: dict[str, tuple[int, int]], spec: LoraSpec, arch, *, seed: int,
                 sequence_parallel: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.kind, self.parts, self.spec, self.arch = kind, parts, spec, arch
        self.column = kind != "row"
        self.sequence_parallel = sequence_parallel
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.shapes = {p: shapes[p] for p in parts}
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for part in targeted:
            out, inp = shapes[part]
            gen = torch.Generator().manual_seed(seed * 1000 + parts.index(part))
            a = torch.empty(spec.rank, inp)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # PEFT's init
            if not self.column:
                a = a.chunk(self.tp, dim=1)[rank]
            b = torch.zeros(out // self.tp if self.column else out, spec.rank)
            self.lora_A[part] = torch.nn.Parameter(a.contiguous())
            self.lora_B[part] = torch.nn.Parameter(b)
            split = self.lora_B[part] if self.column else self.lora_A[part]
            tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if self.column
                                                                 else 1, 1)
            replicated = self.lora_A[part] if self.column else self.lora_B[part]
            replicated.sequence_parallel = sequence_parallel  # grads summed over TP under SP
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout else torch.nn.Identity()
        self.to(device=_device(), dtype=dtype)

    @property
    def targeted(self) -> list[str]:
        return list(self.lora_A.keys())

    def tp_axes(self, prefix: str) -> dict[str, int]:
        """Checkpoint TP axis of each split adapter tensor (replicated ones: none)."""
        if self.column:
            return {f"{prefix}lora_B.{p}": 0 for p in self.targeted}
        return {f"{prefix}lora_A.{p}": 1 for p in self.targeted}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)`` of every part, in the base output's local layout."""
        names = self.targeted
        a = torch.cat([self.lora_A[p] for p in names]).float()
        h = F.linear(self.dropout(x.float()), a)
        h = self._communicate(h)
        outs = dict(zip(names, (F.linear(hp, self.lora_B[p].float())
                                for p, hp in zip(names, h.split(self.spec.rank, dim=-1)))))
        return self._fuse(outs, h.shape[:-1], h) * self.spec.scale

    def _communicate(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return h
        if self.column:
            return (tensor_parallel.gather_from_sequence_parallel_region(h)
                    if self.sequence_parallel
                    else tensor_parallel.copy_to_tensor_model_parallel_region(h))
        return (tensor_parallel.reduce_scatter_to_sequence_parallel_region(h)
                if self.sequence_parallel
                else tensor_parallel.reduce_from_tensor_model_parallel_region(h))

    def _fuse(self, outs: dict[str, torch.Tensor], lead: tuple[int, ...],
              like: torch.Tensor) -> torch.Tensor:
        """The parts' outputs (last dim) in the fused layer's local output layout: ``qkv``
        per local query group [q heads, k, v]; ``gate_up`` [gate shard, up shard]; parts
        that are not targeted are zeros."""
        local = {p: self.shapes[p][0] // (self.tp if self.column else 1) for p in self.parts}
        full = [outs[p] if p in outs else like.new_zeros(*lead, local[p]) for p in self.parts]
        if self.kind != "qkv":
            return full[0] if len(full) == 1 else torch.cat(full, dim=-1)
        groups = self.arch.num_query_groups // self.tp
        return torch.cat([t.reshape(*lead, groups, -1) for t in full], dim=-1) \
            .reshape(*lead, -1)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B A`` of this rank's shard, shaped like the base weight shard (fp32)."""
        outs = {p: self.lora_A[p].float().t() @ self.lora_B[p].float().t()
                for p in self.targeted}
        a = self.lora_A[self.targeted[0]].float()
        return self._fuse(outs, (a.shape[1],), a).t() * self.spec.scale


def _device() -> torch.device:
    from megatron_klear import platform

    return platform.device()


class _LoraLinear:
    """The forward and checkpoint layout added to a megatron linear layer's own class."""

    adapter: LoraAdapter
    _base_axes: dict[str, int]
    lora_enabled: bool = True

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_enabled:
            return out, bias
        return out + self.adapter(self._adapter_input(input_)).to(out.dtype), bias

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the HF projection sees: Transformer Engine's fused norm + linear
        (``layer_norm_weight``) takes the residual stream, so the adapters get its RMSNorm
        (fp32, as TE computes it)."""
        weight = getattr(self, "layer_norm_weight", None)
        if weight is None:
            return x
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(),
                          self.config.layernorm_epsilon)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's sharded tensors plus the adapters split like its weight."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = getattr(self, "tp_group", None) or getattr(self, "_tp_group", None)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix,
            {**self._base_axes, **self.adapter.tp_axes(f"{ADAPTER}.")}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])


# id(base weight) -> its LoRA layer, weakly (nothing is attached to the parameter itself,
# which pickles and copies as before; tensors compare elementwise, so no WeakKeyDictionary)
_OWNERS: dict[int, weakref.ref] = {}
_CLASSES: dict[type, type] = {}


def lora_class(base: type, column: bool) -> type:
    """``base`` (megatron-core's ColumnParallelLinear / RowParallelLinear, or Transformer
    Engine's column / row / LayerNorm-column linear) with LoRA: ``Lora<base>``."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Lora{base.__name__}", (_LoraLinear, base),
                              {"_base_axes": {"weight": 0, "bias": 0} if column
                               else {"weight": 1}, "__module__": __name__})
    return _CLASSES[base]


def apply_lora(model: torch.nn.Module, arch, spec: LoraSpec, *, seed: int = 1234) -> None:
    """Add adapters to the targeted layers of one GPTModel chunk and freeze the rest.

    Raises :class:`ConfigError` for MLP targets of a Qwen3-MoE model's expert layers (not
    supported)."""
    sp = model.config.sequence_parallel
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.decoder.layers:
        number = layer.layer_number - 1
        for suffix, (kind, parts) in LAYERS.items():
            targeted = tuple(p for p in parts if p in spec.targets)
            if not targeted:
                continue
            module = layer.get_submodule(suffix) if _has(layer, suffix) else None
            if module is None:
                raise ConfigError(f"--lora-target-modules {list(targeted)}: layer {number} has "
                                  f"no dense {suffix} (Qwen3-MoE experts take no adapters "
                                  "yet); target the attention projections only")
            if getattr(module.config, "layernorm_zero_centered_gamma", False):
                raise ConfigError("--lora-rank: zero-centred norm weights are not supported")
            module.__class__ = lora_class(type(module), kind != "row")
            module.adapter = LoraAdapter(
                kind, parts, targeted, _part_shapes(arch, kind, parts), spec, arch,
                seed=seed * 10_000 + number * 10 + list(LAYERS).index(suffix),
                sequence_parallel=sp, dtype=model.config.params_dtype)
            _OWNERS[id(module.weight)] = weakref.ref(module)  # merged_weight: base -> adapter


def _has(layer: torch.nn.Module, suffix: str) -> bool:
    """Whether the layer has a dense linear at ``suffix`` (MoE layers have experts there)."""
    try:
        weight = getattr(layer.get_submodule(suffix), "weight", None)
    except AttributeError:
        return False
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def adapters(model_chunks) -> Iterator[tuple[int, str, LoraAdapter]]:
    """(global layer, megatron layer suffix, adapter) of every adapted layer of the chunks."""
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for layer in model.decoder.layers:
            for suffix in LAYERS:
                module = layer.get_submodule(suffix) if _has(layer, suffix) else None
                if isinstance(module, _LoraLinear):
                    yield layer.layer_number - 1, suffix, module.adapter


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP wrappers (as hf_bridge.unwrap_model; models/ does not import
    checkpoint/)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def has_lora(model_chunks) -> bool:
    """Whether any chunk carries adapters."""
    return any(isinstance(m, _LoraLinear) for chunk in model_chunks for m in chunk.modules())


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / checkpoint key belongs to an adapter."""
    return f".{ADAPTER}." in name


def _owner(param: torch.Tensor):
    """The LoRA layer whose base weight is ``param`` (None: no adapter)."""
    ref = _OWNERS.get(id(param))
    owner = ref() if ref is not None else None
    return owner if owner is not None and owner.weight is param else None


def has_adapter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a base weight with LoRA adapters."""
    return _owner(param) is not None


def merged_weight(param: torch.nn.Parameter) -> torch.Tensor:
    """``param`` (a base weight shard) plus its adapters' ``scale * B A``, in its dtype: a new
    tensor, one layer at a time (weight sync, merged HF export). ``param`` itself (detached)
    when it has no adapter or the adapters are off."""
    owner = _owner(param)
    if owner is None or not owner.lora_enabled:
        return param.detach()
    return (param.detach().float() + owner.adapter.delta_weight()).to(param.dtype)


@contextlib.contextmanager
def adapters_disabled(model_chunks) -> Iterator[None]:
    """The base model inside the block: every adapter's branch is skipped (the KL reference
    of a LoRA run: no copy of the model)."""
    modules = [m for chunk in model_chunks for m in _unwrap(chunk).modules()
               if isinstance(m, _LoraLinear)]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True
