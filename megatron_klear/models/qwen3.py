"""Qwen3 (dense and MoE) as a megatron-core GPTModel: a TransformerConfig plus a layer spec.

The Hugging Face ``config.json`` is the single source of truth for the architecture;
:func:`qwen3_config_from_hf` validates it and :func:`build_gpt_model` turns it into one
pipeline stage of a megatron-core ``GPTModel``. Qwen3-MoE (``Qwen3MoeForCausalLM``) layers
use megatron-core's ``MoELayer``: local ``SequentialMLP`` experts in the local spec, Transformer
Engine grouped GEMM in the TE spec (GPU only; not run here).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_block import (LayerNormImpl,
                                                         TransformerBlockSubmodules,
                                                         get_num_layers_to_build)

from megatron_klear import platform
from megatron_klear.config import ConfigError, TrainConfig
from megatron_klear.models.norms import norm_specs
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.models.varlen_attention import PackRotaryEmbedding, VarlenCoreAttention

try:  # Transformer Engine is optional (GPU only)
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    HAVE_TE = True
except Exception:  # pragma: no cover - TE is never importable on the CPU CI machine
    HAVE_TE = False

__all__ = ["Qwen3Arch", "qwen3_config_from_hf", "moe_config_kwargs", "moe_experts_at",
           "MOE_DISPATCHERS", "load_hf_config", "padded_vocab_size",
           "layer_spec", "block_spec", "transformer_config", "TRANSFORMER_IMPLS",
           "check_memory_features", "build_gpt_model", "HAVE_TE", "ConfigError"]

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")


@dataclass(frozen=True)
class Qwen3Arch:
    """The architecture facts of a Qwen3 model, read from an HF config.

    MoE fields stay at their defaults (``num_experts == 0``) for a dense Qwen3;
    ``moe_layers`` holds the global indices of the layers whose MLP is a sparse MoE block.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        """True for a Qwen3-MoE model with at least one sparse layer."""
        return bool(self.moe_layers)


def load_hf_config(hf_dir: str | Path) -> dict:
    """Read ``config.json`` from an HF model directory, with a clear error when absent."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json; pass the directory of a Hugging Face model")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from exc


_MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def qwen3_config_from_hf(cfg: Mapping[str, Any]) -> Qwen3Arch:
    """Validate a Qwen3 or Qwen3-MoE HF config dict and return its :class:`Qwen3Arch`."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in _MODEL_TYPES or (archs and _MODEL_TYPES[model_type] not in archs):
        raise ConfigError(
            f"config.json: model_type={model_type!r} architectures={archs!r}; supported: "
            "Qwen3 (model_type 'qwen3', Qwen3ForCausalLM) and Qwen3-MoE (model_type "
            "'qwen3_moe', Qwen3MoeForCausalLM)"
        )
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"config.json: missing field(s) {missing}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config.json: rope_type {rope_type!r} unsupported (default or yarn)")
    heads = cfg["num_attention_heads"]
    return Qwen3Arch(
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=dict(rope) if rope_type == "yarn" else None,
        hf_config=dict(cfg),
        **(_moe_fields(cfg) if model_type == "qwen3_moe" else {}),
    )


def _moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`Qwen3Arch` MoE fields of a ``qwen3_moe`` config (transformers' rule for
    which layers are sparse: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step
    == 0``)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts),
                              ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size")))
               if v is None]
    if missing:
        raise ConfigError(f"config.json: qwen3_moe config missing field(s) {missing}")
    topk, step = cfg["num_experts_per_tok"], cfg.get("decoder_sparse_step", 1)
    if experts < 1:
        raise ConfigError(f"config.json: num_experts={experts}: a qwen3_moe model needs at "
                          "least one expert (a dense model is model_type 'qwen3')")
    if not 1 <= topk <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok={topk} must be in "
                          f"[1, num_experts={experts}]")
    if step < 1:
        raise ConfigError(f"config.json: decoder_sparse_step={step} must be >= 1")
    dense = set(cfg.get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense and (i + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=topk,
                moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe_layers,
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron's vocab padding: a multiple of ``multiple * tp``."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


def check_parallel_layout(arch: Qwen3Arch, tp: int, pp: int,
                          layout: PipelineLayout | None = None) -> PipelineLayout:
    """The pipeline layout (default: even stages); raises :class:`ConfigError` naming the
    flag when TP/PP cannot split this model."""
    if arch.num_attention_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide "
                          f"num_attention_heads={arch.num_attention_heads}")
    if arch.num_query_groups % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide "
                          f"num_key_value_heads={arch.num_query_groups}")
    layout = layout or PipelineLayout(arch.num_layers, pp)
    if (layout.num_layers, layout.pp) != (arch.num_layers, pp):
        raise ConfigError(f"pipeline layout of {layout.num_layers} layers at PP {layout.pp} "
                          f"does not match the model ({arch.num_layers} layers, PP {pp})")
    return layout


TRANSFORMER_IMPLS = ("transformer_engine", "local")


def layer_spec(transformer_impl: str = "local", num_experts: int | None = None) -> ModuleSpec:
    """The Qwen3 layer spec of ``--transformer-impl``; never picks Transformer Engine silently.

    ``local``: megatron-core's local spec with :mod:`megatron_klear.models.norms` RMSNorms
    (which, unlike megatron's torch-norm wrapper, support sequence parallelism) and
    :class:`VarlenCoreAttention`, so that THD packs attend within each sequence.
    With ``num_experts`` the MLP is megatron-core's MoELayer (local: SequentialMLP experts;
    Transformer Engine: grouped GEMM).
    """
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"--transformer-impl {transformer_impl!r}: choose from "
                          f"{list(TRANSFORMER_IMPLS)}")
    if transformer_impl == "transformer_engine":
        if not HAVE_TE:
            raise ConfigError("--transformer-impl transformer_engine: Transformer Engine is not "
                              "installed (pip install transformer-engine[pytorch]); pass "
                              "--transformer-impl local to use megatron-core's local spec")
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=True)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=True,
                                    normalization="RMSNorm")
    norm, qk_norm = norm_specs()
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = norm
    sub.self_attention.submodules.q_layernorm = qk_norm
    sub.self_attention.submodules.k_layernorm = qk_norm
    sub.self_attention.submodules.core_attention = VarlenCoreAttention
    return spec


def block_spec(config: TransformerConfig, transformer_impl: str = "local",
               vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's (model chunk's) layers plus the final norm (the local spec's
    must support SP); MoE layers where the model has experts."""
    offset = get_transformer_layer_offset(config, vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(transformer_impl, moe_experts_at(config, offset + k))
                     for k in range(get_num_layers_to_build(config, vp_stage))],
        layer_norm=LayerNormImpl if transformer_impl == "transformer_engine" else norm_specs()[0])


def moe_experts_at(config: TransformerConfig, layer: int) -> int | None:
    """The number of experts of global layer ``layer`` (None: a dense MLP), read from the
    ``moe_layer_freq`` pattern that :func:`moe_config_kwargs` sets."""
    if not config.num_moe_experts:
        return None
    freq = config.moe_layer_freq
    sparse = freq[layer] if isinstance(freq, list) else layer % freq == 0
    return config.num_moe_experts if sparse else None


def check_memory_features(config: TransformerConfig, transformer_impl: str) -> None:
    """Raise :class:`ConfigError` for recompute modules megatron-core cannot run without TE."""
    modules = set(config.recompute_modules or ()) if config.recompute_granularity == \
        "selective" else set()
    if not HAVE_TE and modules - {"core_attn"}:
        # megatron-core 0.16.1 references TE's FP8GlobalStateManager when recomputing these
        raise ConfigError(f"--recompute-modules {sorted(modules - {'core_attn'})} needs "
                          "Transformer Engine installed (megatron-core 0.16.1 fails without it);"
                          " use --recompute-modules core_attn or --recompute-granularity full")


MOE_DISPATCHERS = ("alltoall", "allgather")


def moe_config_kwargs(arch: Qwen3Arch, *, ep: int = 1, etp: int | None = None,
                      dispatcher: str = "alltoall", aux_loss_coeff: float | None = None,
                      routing_replay: bool = False) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE model ({} for a dense one).

    transformers' router is softmax over all experts, top-k, then (``norm_topk_prob``)
    renormalised over the k: megatron's softmax after top-k (``pre_softmax=False``) equals
    the renormalised form, softmax before top-k the raw one. ``aux_loss_coeff`` None takes
    config.json's ``router_aux_loss_coef``; 0 turns the load-balancing loss off.
    ``routing_replay``: the routers can replay given experts (models/routing_replay.py).
    """
    if not arch.is_moe:
        return {}
    if arch.num_experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide "
                          f"num_experts={arch.num_experts}")
    if dispatcher not in MOE_DISPATCHERS:
        raise ConfigError(f"--moe-token-dispatcher-type {dispatcher!r}: choose from "
                          f"{list(MOE_DISPATCHERS)}")
    coeff = arch.router_aux_loss_coef if aux_loss_coeff is None else aux_loss_coeff
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=[int(i in arch.moe_layers) for i in range(arch.num_layers)],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_token_dispatcher_type=dispatcher,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_enable_routing_replay=routing_replay,
    )


def transformer_config(arch: Qwen3Arch, *, tp: int = 1, pp: int = 1,
                       params_dtype: torch.dtype = torch.float32,
                       layout: PipelineLayout | None = None,
                       **overrides: Any) -> TransformerConfig:
    """The megatron-core TransformerConfig of a Qwen3 model at a TP/PP (``layout``) split (MoE
    fields from :func:`moe_config_kwargs`; ``overrides`` win, e.g. ``expert_model_parallel_size``)."""
    layout = check_parallel_layout(arch, tp, pp, layout)
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        **layout.transformer_config_fields(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        init_method_std=0.02,
    )
    kwargs.update(moe_config_kwargs(arch))
    kwargs.update(overrides)
    cfg = TransformerConfig(**kwargs)
    if arch.rope_scaling:
        rs = arch.rope_scaling
        cfg.yarn_rotary_scaling_factor = float(rs.get("factor", 1.0))
        cfg.yarn_original_max_position_embeddings = int(
            rs.get("original_max_position_embeddings", arch.max_position_embeddings))
        cfg.yarn_beta_fast = float(rs.get("beta_fast", 32.0))
        cfg.yarn_beta_slow = float(rs.get("beta_slow", 1.0))
        cfg.yarn_mscale = float(rs.get("mscale", 1.0))
        cfg.yarn_mscale_all_dim = float(rs.get("mscale_all_dim", 0.0))
        cfg.yarn_correction_range_round_to_int = True
    return cfg


def build_gpt_model(arch: Qwen3Arch, config: TransformerConfig, *, pre_process: bool | None = None,
                    post_process: bool | None = None, transformer_impl: str = "local",
                    vp_stage: int | None = None) -> GPTModel:
    """One pipeline stage (model chunk ``vp_stage`` with interleaving) of the Qwen3
    GPTModel, built on the device (stage flags default to this rank's)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
    check_memory_features(config, transformer_impl)
    if config.context_parallel_size > 1 and transformer_impl != "transformer_engine":
        raise ConfigError(f"--context-parallel-size {config.context_parallel_size} needs "
                          "--transformer-impl transformer_engine (the local attention cannot "
                          "attend across CP ranks)")
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, transformer_impl, vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="yarn" if arch.rope_scaling else "rope",
        rotary_base=int(arch.rope_theta),
        vp_stage=vp_stage,
    )
    cores = [m for m in model.modules() if isinstance(m, VarlenCoreAttention)]
    if cores and not arch.rope_scaling:  # THD packs are rotated per token by the core attention
        if type(model.rotary_pos_emb) is not RotaryEmbedding:
            raise TypeError(f"expected megatron's RotaryEmbedding for plain RoPE, got "
                            f"{type(model.rotary_pos_emb).__name__}")
        model.rotary_pos_emb.__class__ = PackRotaryEmbedding  # same state, packs left unrotated
        for module in cores:
            module.position_emb = model.rotary_pos_emb.get_emb
    return model


# ------------------------------------------------------ the model of a trainer config
def model_features(cfg: TrainConfig) -> dict[str, Any]:
    """TransformerConfig fields of the sequence-parallel and recompute flags (and the
    platform's pipeline send mode)."""
    features: dict[str, Any] = {"sequence_parallel": cfg.sequence_parallel,
                                "batch_p2p_comm": platform.batch_p2p_comm()}
    if cfg.recompute_granularity:
        features.update(recompute_granularity=cfg.recompute_granularity,
                        recompute_method=cfg.recompute_method,
                        recompute_num_layers=cfg.recompute_num_layers)
    if cfg.recompute_granularity == "selective":
        features["recompute_modules"] = list(cfg.recompute_modules or ["core_attn"])
    return features


def moe_features(arch: Qwen3Arch, cfg: TrainConfig) -> dict[str, Any]:
    """TransformerConfig fields of the MoE flags ({} for a dense model)."""
    return moe_config_kwargs(arch, ep=cfg.expert_model_parallel_size, etp=cfg.expert_tp,
                             dispatcher=cfg.moe_token_dispatcher_type,
                             aux_loss_coeff=cfg.moe_aux_loss_coeff,
                             routing_replay=cfg.use_routing_replay)


def build_model_chunks(arch: Qwen3Arch, cfg: TrainConfig) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) at ``cfg``'s parallel layout
    and memory / MoE features, built on the device as the trainers build them (the engine
    wraps them in DDP; compare_logits evaluates them)."""
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    layout = PipelineLayout.from_config(arch.num_layers, cfg)
    tconf = transformer_config(arch, tp=cfg.tensor_model_parallel_size,
                               pp=cfg.pipeline_model_parallel_size, params_dtype=dtype,
                               layout=layout, context_parallel_size=cfg.context_parallel_size,
                               **model_features(cfg), **moe_features(arch, cfg))
    return [build_gpt_model(arch, tconf, transformer_impl=cfg.transformer_impl,
                            vp_stage=i if layout.virtual_size else None)
            for i in range(layout.num_model_chunks)]
