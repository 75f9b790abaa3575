"""The one mapping between Hugging Face Qwen3 tensors and megatron-core parameters.

Every consumer (HF -> Megatron loading into a live model, export of a live model and
weight sync to SGLang, and the streaming converters, which walk a meta-device model with
:func:`param_rules`) goes through the :data:`RULES` table below, so a fix (or a new kind,
e.g. MoE experts) lands everywhere.

A rule names the HF tensor(s), the megatron-core parameter names in the local spec and in
the Transformer Engine spec (where the input/pre-MLP RMSNorms are fused into
``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``) and a *kind* that says how the
full tensor is split over tensor-parallel ranks and merged back:

* ``replicated`` -- every TP rank holds the full tensor (norms);
* ``row`` -- split on the input dimension (1);
* ``vocab`` -- split on the output dimension (0) after zero-padding the vocabulary to
  Megatron's padded size;
* ``qkv`` -- q/k/v stacked per query group ([q heads of the group, k, v]), then split;
* ``gate_up`` -- each rank holds [gate shard; up shard], so halves regroup per rank.

Pipeline parallelism needs no table entry: each transformer layer knows its global
``layer_number``, which maps ``decoder.layers.{j}`` to ``model.layers.{i}``.

Qwen3-MoE: a rule applies to ``dense`` layers, ``moe`` layers or ``all``. The router
(``mlp.gate``) is replicated. Expert rules (``expert=True``) map local expert ``{k}`` of
this expert-parallel (EP) rank to global expert ``{e} = ep_rank * local_experts + k``; their
``gate_up`` / ``row`` splits run over the expert-tensor-parallel (ETP) group, not TP, and
export all-gathers them over ETP, then over EP, so every rank receives every expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from megatron_klear.models.qwen3 import Qwen3Arch, padded_vocab_size

__all__ = ["Rule", "RULES", "BridgeError", "hf_tensor_names", "load_hf_weights",
           "export_hf_weights", "hf_state_dict_from_megatron", "split_for_rank",
           "split_parts_for_rank", "merge_shards", "merge_views",
           "unwrap_model", "param_rules", "check_hf_names", "check_hf_shape", "hf_shape"]

HfTensors = Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]


class BridgeError(ValueError):
    """A checkpoint that does not match the model; the message names the tensor."""


@dataclass(frozen=True)
class Rule:
    """One HF <-> Megatron correspondence.

    ``hf`` templates use ``{i}`` for the global layer index and ``{e}`` for the global
    expert; ``megatron`` templates use ``{j}`` for the layer index inside a model chunk and
    ``{k}`` for the expert index on this EP rank (local spec name first, then TE).
    ``layers``: which layers hold it (``all``, ``dense`` or ``moe``).
    """

    hf: tuple[str, ...]
    megatron: tuple[str, ...]
    kind: str
    layers: str = "all"
    expert: bool = False


_L = "model.layers.{i}."
_M = "decoder.layers.{j}."
RULES: tuple[Rule, ...] = (
    Rule(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), "vocab"),
    Rule(("model.norm.weight",), ("decoder.final_layernorm.weight",), "replicated"),
    Rule(("lm_head.weight",), ("output_layer.weight",), "vocab"),
    Rule((_L + "input_layernorm.weight",),
         (_M + "input_layernorm.weight", _M + "self_attention.linear_qkv.layer_norm_weight"),
         "replicated"),
    Rule((_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight",
          _L + "self_attn.v_proj.weight"), (_M + "self_attention.linear_qkv.weight",), "qkv"),
    Rule((_L + "self_attn.o_proj.weight",), (_M + "self_attention.linear_proj.weight",), "row"),
    Rule((_L + "self_attn.q_norm.weight",), (_M + "self_attention.q_layernorm.weight",),
         "replicated"),
    Rule((_L + "self_attn.k_norm.weight",), (_M + "self_attention.k_layernorm.weight",),
         "replicated"),
    Rule((_L + "post_attention_layernorm.weight",),
         (_M + "pre_mlp_layernorm.weight", _M + "mlp.linear_fc1.layer_norm_weight"),
         "replicated"),
    Rule((_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
         (_M + "mlp.linear_fc1.weight",), "gate_up", layers="dense"),
    Rule((_L + "mlp.down_proj.weight",), (_M + "mlp.linear_fc2.weight",), "row",
         layers="dense"),
    Rule((_L + "mlp.gate.weight",), (_M + "mlp.router.weight",), "replicated", layers="moe"),
    Rule((_L + "mlp.experts.{e}.gate_proj.weight", _L + "mlp.experts.{e}.up_proj.weight"),
         (_M + "mlp.experts.local_experts.{k}.linear_fc1.weight",
          _M + "mlp.experts.linear_fc1.weight{k}"), "gate_up", layers="moe", expert=True),
    Rule((_L + "mlp.experts.{e}.down_proj.weight",),
         (_M + "mlp.experts.local_experts.{k}.linear_fc2.weight",
          _M + "mlp.experts.linear_fc2.weight{k}"), "row", layers="moe", expert=True),
)


def _compile(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{j\}", r"(?P<j>\d+)")
                      .replace(r"\{k\}", r"(?P<k>\d+)") + "$")


_PATTERNS: tuple[tuple[re.Pattern, Rule], ...] = tuple(
    (_compile(t), rule) for rule in RULES for t in rule.megatron)


def hf_tensor_names(arch: Qwen3Arch) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of ``arch`` holds (HF tying convention)."""
    names = []
    for rule in RULES:
        for t in rule.hf:
            if "{i}" in t:
                names.extend(t.format(i=i, e=e) for i in _layers(rule, arch)
                             for e in range(arch.num_experts if rule.expert else 1))
            elif not (t == "lm_head.weight" and arch.tie_word_embeddings):
                names.append(t)
    return names


def _layers(rule: Rule, arch: Qwen3Arch) -> list[int]:
    """The global layers that hold ``rule``'s tensors."""
    moe = set(arch.moe_layers)
    return [i for i in range(arch.num_layers)
            if rule.layers == "all" or (i in moe) == (rule.layers == "moe")]


# ---------------------------------------------------------------- TP split / merge
def _qkv_groups(arch: Qwen3Arch) -> tuple[int, int, int]:
    return arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups, arch.head_dim


def split_for_rank(kind: str, full: list[torch.Tensor], arch: Qwen3Arch, tp: int,
                   rank: int) -> torch.Tensor:
    """This TP rank's shard of the Megatron parameter built from full HF tensors."""
    return _cat(split_parts_for_rank(kind, full, arch, tp, rank))


def split_parts_for_rank(kind: str, full: list[torch.Tensor], arch: Qwen3Arch, tp: int,
                         rank: int) -> list[torch.Tensor]:
    """:func:`split_for_rank` as the tensors whose concatenation on dim 0 is the shard
    (``gate_up``: [gate shard, up shard]; one tensor for other kinds). A streaming writer
    that saves gate and up as separate checkpoint chunks then needs no concatenation."""
    if kind == "gate_up":
        gate, up = full
        return [gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]
    return [_split_whole(kind, full, arch, tp, rank)]


def _split_whole(kind: str, full: list[torch.Tensor], arch: Qwen3Arch, tp: int,
                 rank: int) -> torch.Tensor:
    if kind == "replicated":
        return full[0]
    if kind == "row":
        return full[0].chunk(tp, dim=1)[rank]
    if kind == "vocab":
        w = full[0]
        pad = padded_vocab_size(arch.vocab_size, tp) - w.shape[0]
        w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w
        return w.chunk(tp, dim=0)[rank]
    if kind == "qkv":
        q, k, v = full
        groups, per_group, head_dim = _qkv_groups(arch)
        hidden = q.shape[-1]
        stacked = torch.cat([q.reshape(groups, per_group * head_dim, hidden),
                             k.reshape(groups, head_dim, hidden),
                             v.reshape(groups, head_dim, hidden)], dim=1)
        return stacked.reshape(-1, hidden).chunk(tp, dim=0)[rank]
    raise ValueError(f"unknown rule kind {kind!r}")


def _cat(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, without a copy for a single shard (TP=1)."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def merge_shards(kind: str, shards: list[torch.Tensor], arch: Qwen3Arch) -> list[torch.Tensor]:
    """The full HF tensors (in ``Rule.hf`` order) from all TP ranks' shards, rank order.

    At TP=1 the results may be views of the shards (q/k/v are copies).
    """
    return [v.reshape(-1, v.shape[-1]) if kind == "qkv" else v
            for v in merge_views(kind, shards, arch)]


def merge_views(kind: str, shards: list[torch.Tensor], arch: Qwen3Arch) -> list[torch.Tensor]:
    """:func:`merge_shards` before the final q/k/v reshape: at TP=1 every result is a view
    of the shard whose row-major elements are the HF tensor's (q/k/v: [groups, rows,
    hidden], one block of rows per query group). A writer can then copy the bytes straight
    from the shard's storage, or find them from a meta tensor's strides."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "row":
        return [_cat(shards, dim=1)]
    if kind == "vocab":
        return [_cat(shards)[: arch.vocab_size]]
    if kind == "qkv":
        groups, per_group, head_dim = _qkv_groups(arch)
        hidden = shards[0].shape[-1]
        stacked = _cat(shards).reshape(groups, (per_group + 2) * head_dim, hidden)
        q_rows = per_group * head_dim
        return [stacked[:, :q_rows], stacked[:, q_rows:q_rows + head_dim],
                stacked[:, q_rows + head_dim:]]
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]
    raise ValueError(f"unknown rule kind {kind!r}")


# ---------------------------------------------------------------- model walking
def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _tp(rule: Rule | None = None) -> tuple[int, int, object]:
    """(size, rank, group) of the group a rule's tensors split over: TP, or for experts ETP."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    if rule is not None and rule.expert:
        return (ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def _ep() -> tuple[int, int, object]:
    """(size, rank, group) of expert parallelism (1, 0, None outside megatron)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_group())


def _hf_names(rule: Rule, layer: int | None, local_expert: int | None,
              arch: Qwen3Arch) -> list[str]:
    """The HF names of ``rule`` for a layer and (experts) a local expert of this EP rank."""
    if not rule.expert:
        return [t.format(i=layer) for t in rule.hf]
    ep, ep_rank, _ = _ep()
    e = ep_rank * (arch.num_experts // ep) + local_expert
    return [t.format(i=layer, e=e) for t in rule.hf]


def _global_layer(model: torch.nn.Module, local: int) -> int:
    return model.decoder.layers[local].layer_number - 1


def param_rules(model_chunks: list[torch.nn.Module], arch: Qwen3Arch
            ) -> Iterator[tuple[str, torch.nn.Parameter, Rule, list[str]]]:
    """(megatron name, parameter, rule, HF names) for every parameter of these chunks.

    The one walk over the :data:`RULES` table: loading, export, weight sync and the
    streaming converters (which walk a model on the meta device) all start here.
    """
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in model.named_parameters():
            rule, match = next(((r, m) for p, r in _PATTERNS if (m := p.match(name))),
                               (None, None))
            if rule is None:
                raise BridgeError(f"megatron parameter {name!r} has no Hugging Face mapping "
                                  "(only Qwen3 and Qwen3-MoE are supported)")
            groups = match.groupdict()
            layer = _global_layer(model, int(groups["j"])) if "j" in groups else None
            local = int(groups["k"]) if "k" in groups else None
            hf = _hf_names(rule, layer, local, arch)
            if hf == ["lm_head.weight"] and arch.tie_word_embeddings:
                hf = ["model.embed_tokens.weight"]  # last-stage copy of the tied embedding
            yield name, param, rule, hf


# ---------------------------------------------------------------- HF -> Megatron
def _getter(hf_tensors: HfTensors) -> Callable[[str], torch.Tensor]:
    if isinstance(hf_tensors, Mapping):
        def get(name: str) -> torch.Tensor:
            if name not in hf_tensors:
                raise BridgeError(f"missing tensor {name!r} in the Hugging Face checkpoint")
            return hf_tensors[name]
        return get

    def get_callable(name: str) -> torch.Tensor:
        try:
            return hf_tensors(name)
        except KeyError as exc:
            raise BridgeError(f"missing tensor {name!r} in the Hugging Face checkpoint") from exc
    return get_callable


def check_hf_names(names: list[str] | set[str], arch: Qwen3Arch) -> None:
    """Raise :class:`BridgeError` naming the first missing or unexpected HF tensor."""
    expected = set(hf_tensor_names(arch))
    allowed = expected | ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    unexpected = sorted(set(names) - allowed)
    if unexpected:
        raise BridgeError(f"unexpected tensor {unexpected[0]!r} in the Hugging Face checkpoint "
                          f"({len(unexpected)} unexpected); it is not part of a "
                          f"{'Qwen3-MoE' if arch.is_moe else 'dense Qwen3'} with "
                          f"{arch.num_layers} layers")
    missing = sorted(expected - set(names))
    if missing:
        raise BridgeError(f"missing tensor {missing[0]!r} in the Hugging Face checkpoint "
                          f"({len(missing)} missing)")


@torch.no_grad()
def load_hf_weights(model_chunks: list[torch.nn.Module], arch: Qwen3Arch,
                    hf_tensors: HfTensors) -> None:
    """Fill this rank's parameter shards from full HF tensors (TP split, PP offsets, padding).

    ``hf_tensors`` is a mapping (checked for missing and unexpected names) or a callable
    ``name -> tensor`` (e.g. over lazily opened safetensors shards; raises ``KeyError`` for a
    missing name). Shapes are checked per tensor; errors name the tensor.
    """
    if isinstance(hf_tensors, Mapping):
        check_hf_names(list(hf_tensors.keys()), arch)
    get = _getter(hf_tensors)
    for _, param, rule, hf in param_rules(model_chunks, arch):
        tp, rank, _ = _tp(rule)
        _fill(param, rule, hf, [get(n) for n in hf], arch, tp, rank)


def _fill(param: torch.nn.Parameter, rule: Rule, hf: list[str], full: list[torch.Tensor],
          arch: Qwen3Arch, tp: int, rank: int) -> None:
    for n, t in zip(hf, full):
        check_hf_shape(n, tuple(t.shape), arch)
    param.copy_(split_for_rank(rule.kind, full, arch, tp, rank))


def check_hf_shape(name: str, shape: tuple[int, ...], arch: Qwen3Arch) -> None:
    """Raise :class:`BridgeError` naming ``name`` when its shape disagrees with config.json."""
    if tuple(shape) != hf_shape(name, arch):
        raise BridgeError(f"shape mismatch for tensor {name!r}: the checkpoint has "
                          f"{tuple(shape)}, config.json implies {hf_shape(name, arch)}")


def hf_shape(name: str, arch: Qwen3Arch) -> tuple[int, ...]:
    """The shape ``config.json`` implies for the HF tensor ``name``."""
    h, ffn, hd = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    suffix = re.sub(r"^model\.layers\.\d+\.", "", name)
    suffix = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.E.", suffix)
    moe_ffn = arch.moe_ffn_hidden_size
    shapes = {
        "model.embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,), "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
    }
    if arch.is_moe:
        shapes.update({"mlp.gate.weight": (arch.num_experts, h),
                       "mlp.experts.E.gate_proj.weight": (moe_ffn, h),
                       "mlp.experts.E.up_proj.weight": (moe_ffn, h),
                       "mlp.experts.E.down_proj.weight": (h, moe_ffn)})
    if suffix not in shapes:
        raise BridgeError(f"unexpected tensor {name!r}: not part of a "
                          f"{'Qwen3-MoE' if arch.is_moe else 'dense Qwen3'} checkpoint")
    return shapes[suffix]


# ---------------------------------------------------------------- Megatron -> HF
def _gather_tp(shard: torch.Tensor, tp: int, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if tp == 1:
        return [shard]
    out = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(out, shard.contiguous(), group=group)
    return out


@torch.no_grad()
def export_hf_weights(model_chunks: list[torch.nn.Module], arch: Qwen3Arch, *,
                      copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full HF-named tensors for the layers of THIS pipeline stage.

    Collective over the tensor-parallel group: every TP rank of the stage must iterate it
    to the end, and every TP rank receives the full tensors. Vocabulary padding is
    stripped; with tied embeddings ``lm_head.weight`` is not emitted (HF convention).
    Tensors keep the parameters' dtype. With ``copy=True`` they are contiguous tensors that
    share no memory with the model (safe to keep or save); with ``copy=False`` they may be
    views of the parameters, valid until the next optimizer step (weight sync packs them
    into its own buffers, so it skips the extra copy).
    """
    for _, param, rule, hf in param_rules(model_chunks, arch):
        if rule.megatron[0] == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        tp, _, group = _tp(rule)
        merged = merge_shards(rule.kind, _gather_tp(param.detach(), tp, group), arch)
        named = zip(hf, merged)
        if rule.expert:
            named = _gather_experts(hf, merged, arch)
        for n, t in named:
            shared = t.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            yield n, (t.clone(memory_format=torch.contiguous_format) if copy and shared
                      else t.contiguous())


_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


def _gather_experts(hf: list[str], merged: list[torch.Tensor], arch: Qwen3Arch
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every EP rank's copy of this local expert (all-gathered over the EP group), named by
    global expert. Every EP rank walks the same local experts in the same order."""
    ep, rank, group = _ep()
    local = arch.num_experts // ep
    per_rank = [_gather_tp(m, ep, group) for m in merged]  # [HF tensor][EP rank]
    for r in range(ep):
        for n, gathered in zip(hf, per_rank):
            e = int(_EXPERT.search(n).group(1)) + (r - rank) * local
            yield _EXPERT.sub(f"mlp.experts.{e}.", n), gathered[r]


def hf_state_dict_from_megatron(model_chunks: list[torch.nn.Module], arch: Qwen3Arch
                                ) -> dict[str, torch.Tensor]:
    """This stage's HF state dict (see :func:`export_hf_weights`); collective over TP."""
    return dict(export_hf_weights(model_chunks, arch))
