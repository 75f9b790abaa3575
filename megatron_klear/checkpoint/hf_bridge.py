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

from megatron_klear.models.lora import has_adapter, is_adapter_key, merged_weight
from megatron_klear.models.qwen3 import Qwen3Arch, padded_vocab_size

__all__ = ["Rule", "RULES", "BridgeError", "hf_tensor_names", "load_hf_weights",
           "export_hf_weights", "export_entries", "export_views", "export_gathers",
           "export_aliases",
           "hf_state_dict_from_megatron", "split_for_rank", "split_parts_for_rank",
           "merge_shards", "merge_views", "concat_rows",
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
    """:func:`split_for_rank` as the tensors whose concatenation on dim 0 is the shard, as
    views of ``full`` where the layout allows (``qkv``: the rows of each query group's q,
    k and v; ``gate_up``: [gate shard, up shard]; ``vocab``: the rows and the zero padding).
    A streaming writer then writes the parameter from the input bytes, with no copy."""
    if kind == "gate_up":
        gate, up = full
        return [gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]
    if kind == "qkv":
        groups, per_group, head_dim = _qkv_groups(arch)
        q, k, v = (t.reshape(groups, -1, t.shape[-1]) for t in full)
        return _rank_rows([t[g] for g in range(groups) for t in (q, k, v)], tp, rank)
    if kind == "vocab":
        w = full[0]
        pad = padded_vocab_size(arch.vocab_size, tp) - w.shape[0]
        return _rank_rows([w, w.new_zeros(pad, *w.shape[1:])] if pad else [w], tp, rank)
    if kind == "replicated":
        return [full[0]]
    if kind == "row":
        return [full[0].chunk(tp, dim=1)[rank]]
    raise ValueError(f"unknown rule kind {kind!r}")


def _rank_rows(parts: list[torch.Tensor], tp: int, rank: int) -> list[torch.Tensor]:
    """TP rank ``rank``'s equal share of the rows of the concatenation of ``parts`` (dim 0),
    as views of the parts."""
    rows = sum(p.shape[0] for p in parts) // tp
    return concat_rows(parts, rank * rows, (rank + 1) * rows)


def concat_rows(parts: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Rows ``lo:hi`` of the concatenation of ``parts`` on dim 0, as views of the parts
    (the concatenation itself is never built)."""
    start, out = 0, []
    for p in parts:
        a, b = max(lo, start), min(hi, start + p.shape[0])
        if a < b:
            out.append(p[a - start:b - start])
        start += p.shape[0]
    return out


def _cat(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, without a copy for a single shard (TP=1)."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def merge_shards(kind: str, shards: list[torch.Tensor], arch: Qwen3Arch) -> list[torch.Tensor]:
    """The full HF tensors (in ``Rule.hf`` order) from all TP ranks' shards, rank order.

    At TP=1 the results may be views of the shards.
    """
    return [v.reshape(shape) for v, shape in merge_views(kind, _cat(shards), len(shards), arch)]


def merge_views(kind: str, stacked: torch.Tensor, tp: int, arch: Qwen3Arch
                ) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """(view, HF shape) of each full HF tensor (``Rule.hf`` order), from the TP shards stacked
    on dim 0 (``stacked``; at TP=1 the parameter itself).

    A view may have another shape than the HF tensor (a de-interleaved q/k/v, a TP-split row
    weight), but its elements in row-major order are the HF tensor's: copying it into a
    contiguous buffer viewed with ``view.shape`` writes the HF tensor's bytes with one copy,
    and ``view.reshape(shape)`` is the HF tensor. No data is copied here.
    """
    if kind == "replicated":
        rows = stacked.shape[0] // tp  # every rank's copy is the same: the first
        return [(stacked[:rows], (rows, *stacked.shape[1:]))]
    if kind == "row":
        out = stacked.shape[0] // tp
        view = stacked.view(tp, out, -1).permute(1, 0, 2) if tp > 1 else stacked
        return [(view, (out, stacked.shape[1] * tp))]
    if kind == "vocab":
        return [(stacked[: arch.vocab_size], (arch.vocab_size, *stacked.shape[1:]))]
    if kind == "qkv":
        groups, per_group, head_dim = _qkv_groups(arch)
        hidden = stacked.shape[-1]
        qkv = stacked.view(groups, per_group + 2, head_dim, hidden)
        return [(qkv[:, :per_group], (groups * per_group * head_dim, hidden)),
                (qkv[:, per_group], (groups * head_dim, hidden)),
                (qkv[:, per_group + 1], (groups * head_dim, hidden))]
    if kind == "gate_up":
        halves = stacked.view(tp, 2, stacked.shape[0] // (2 * tp), -1)
        shape = (stacked.shape[0] // 2, halves.shape[-1])
        return [(halves[:, 0], shape), (halves[:, 1], shape)]
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
            if is_adapter_key(name):  # LoRA adapters: merged into their base (export_views)
                continue
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
def _gather_tp(shard: torch.Tensor, tp: int, group) -> torch.Tensor:
    """All TP ranks' shards stacked on dim 0, gathered straight into one tensor (the shard
    itself at TP=1)."""
    import torch.distributed as dist

    if tp == 1:
        return shard
    out = shard.new_empty((tp * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


def export_entries(model_chunks: list[torch.nn.Module], arch: Qwen3Arch
                   ) -> list[tuple[torch.nn.Parameter, Rule, list[str]]]:
    """(parameter, rule, HF names) of every parameter this stage exports, in export order.

    The walk over the :data:`RULES` table, done once: a caller that exports repeatedly (weight
    sync) keeps the list while the model lives and passes it to :func:`export_views`.
    """
    return [(param, rule, hf) for _, param, rule, hf in param_rules(model_chunks, arch)
            if not (rule.megatron[0] == "output_layer.weight" and arch.tie_word_embeddings)]


def export_gathers() -> bool:
    """Whether :func:`export_views` all-gathers (TP, expert-TP or EP > 1). When it does not,
    its views are of the parameters and stay valid while they keep their storage."""
    return any(size > 1 for size in (_tp()[0], _tp(Rule((), (), "row", expert=True))[0],
                                     _ep()[0]))


def export_aliases(entries: list[tuple[torch.nn.Parameter, Rule, list[str]]]) -> bool:
    """Whether :func:`export_views` yields views of the parameters themselves (no gathers and
    no LoRA adapter merged into any of them), which then show their current values."""
    return not export_gathers() and not any(has_adapter(p) for p, _, _ in entries)


@torch.no_grad()
def export_views(entries: list[tuple[torch.nn.Parameter, Rule, list[str]]], arch: Qwen3Arch
                 ) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(HF name, view, HF shape) for every tensor of :func:`export_entries`, nothing copied
    beyond the TP gathers (see :func:`merge_views`; without gathers every view aliases its
    parameter, so it shows the parameter's current values). A weight with LoRA adapters is
    exported merged (``W + scale B A``, :func:`~megatron_klear.models.lora.merged_weight`):
    one new tensor per such parameter, made as the walk reaches it.

    Collective over the tensor-parallel group (and, for experts, expert-TP and EP): every rank
    of the stage must iterate it to the end.
    """
    for param, rule, hf in entries:
        tp, _, group = _tp(rule) if rule.kind != "replicated" else (1, 0, None)
        views = merge_views(rule.kind, _gather_tp(merged_weight(param), tp, group), tp, arch)
        if rule.expert:
            yield from _gather_experts(hf, [v.reshape(shape) for v, shape in views], arch)
        else:
            yield from ((n, v, shape) for n, (v, shape) in zip(hf, views))


@torch.no_grad()
def export_hf_weights(model_chunks: list[torch.nn.Module], arch: Qwen3Arch, *,
                      copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full HF-named tensors for the layers of THIS pipeline stage.

    Collective over the tensor-parallel group: every TP rank of the stage must iterate it
    to the end, and every TP rank receives the full tensors. Vocabulary padding is
    stripped; with tied embeddings ``lm_head.weight`` is not emitted (HF convention).
    Tensors keep the parameters' dtype. With ``copy=True`` they are contiguous tensors that
    share no memory with the model (safe to keep or save); with ``copy=False`` they may be
    views of the parameters, valid until the next optimizer step.
    """
    entries = export_entries(model_chunks, arch)
    storages = {p.untyped_storage().data_ptr() for p, _, _ in entries}
    for n, view, shape in export_views(entries, arch):
        t = view.reshape(shape)
        shared = t.untyped_storage().data_ptr() in storages
        yield n, (t.clone(memory_format=torch.contiguous_format) if copy and shared
                  else t.contiguous())


_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


def _gather_experts(hf: list[str], merged: list[torch.Tensor], arch: Qwen3Arch
                    ) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """Every EP rank's copy of this local expert (all-gathered over the EP group), named by
    global expert. Every EP rank walks the same local experts in the same order."""
    ep, rank, group = _ep()
    local = arch.num_experts // ep
    per_rank = [_gather_tp(m, ep, group).reshape(ep, *m.shape) for m in merged]  # [HF][EP rank]
    for r in range(ep):
        for n, gathered in zip(hf, per_rank):
            e = int(_EXPERT.search(n).group(1)) + (r - rank) * local
            yield _EXPERT.sub(f"mlp.experts.{e}.", n), gathered[r], tuple(gathered.shape[1:])


def hf_state_dict_from_megatron(model_chunks: list[torch.nn.Module], arch: Qwen3Arch
                                ) -> dict[str, torch.Tensor]:
    """This stage's HF state dict (see :func:`export_hf_weights`); collective over TP."""
    return dict(export_hf_weights(model_chunks, arch))
