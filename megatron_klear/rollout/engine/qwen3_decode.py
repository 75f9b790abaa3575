"""The embedded server's Qwen3 forward: transformers' own modules, called layer by layer over
a preallocated KV cache.

transformers' ``Qwen3ForCausalLM.forward`` (modeling_qwen3.py) spends most of a tiny model's
decode step outside arithmetic: mask construction, cache bookkeeping, kwargs plumbing and
output dataclasses, several hundred small ops per step. :func:`forward` computes the same
thing from the same modules and weights -- projections, rotary embedding and
``apply_rotary_pos_emb``, the MLP or sparse-MoE block, ``lm_head``; the RMSNorms as one fused
``rms_norm`` each -- with eager grouped-query attention and an fp32 softmax
(``eager_attention_forward``), so its logits are transformers' to fp32 rounding
(tests/multiprocess/test_rollout_server.py compares them). Full attention only, as Qwen3 and Qwen3-MoE
use; a config with sliding-window layers is refused by :func:`check_supported`.

An fp32 model on the CPU runs the extension's kernels (csrc/cpu/decode_cpu.h: the same math in
one pass per row and head, where torch spends a decode step on per-op overhead):
``klear::rms_norm``, ``klear::qk_norm_rope`` (q_norm / k_norm and the rotary embedding) and,
for one-token steps, ``klear::decode_attention``, which is why the cache keeps its keys
transposed. Its one-token steps of at least ONEDNN_MIN_ROWS rows run their projections through
oneDNN (``platform.onednn_linear``) with q|k|v and gate|up fused (:class:`FusedWeights`): MKL's
sgemm runs its AVX2 code on AMD CPUs with AVX-512, and these GEMMs are most of a decode step.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_klear import platform
from megatron_klear.ops.rms_norm import rms_norm

__all__ = ["KVCache", "FusedWeights", "check_supported", "forward", "grouped_attention",
           "ONEDNN_MIN_ROWS"]

# the decode kernel reads positions in blocks of this many (cache capacities are multiples)
DECODE_BLOCK = 16
# a one-token step of at least this many rows runs its projections through oneDNN; below, MKL's
# sgemm is as fast (benchmarks/bench_cpu_gemm.py), and the few row counts keep oneDNN's
# kernels (one built per shape) few
ONEDNN_MIN_ROWS = 16


def check_supported(config) -> None:
    """Raise for a config this forward would compute wrongly (sliding-window layers)."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"the embedded rollout server runs full attention only; this config "
                         f"has layer_types {sorted(kinds)} (use_sliding_window="
                         f"{getattr(config, 'use_sliding_window', False)}): serve it with "
                         "SGLang (--rollout-urls)")


def grouped_attention(query: torch.Tensor, key_t: torch.Tensor, value: torch.Tensor,
                      bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """transformers' eager attention (fp32 softmax, additive mask ``bias`` [b, 1, t, s]) for
    grouped-query attention without ``repeat_kv``: the query heads of one KV head are stacked
    along the query axis, so the cache is read in place (``key_t``: the keys transposed,
    [b, kv, d, s]). Returns [b, t, h * d]."""
    b, h, t, d = query.shape
    kv = key_t.shape[1]
    q = query.reshape(b, kv, (h // kv) * t, d)
    weights = torch.matmul(q, key_t) * scaling
    s = weights.shape[-1]
    weights = (weights.view(b, kv, h // kv, t, s) + bias[:, :, None]).view(b, kv, -1, s)
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).view(b, h, t, d)
    return out.transpose(1, 2).reshape(b, t, h * d)


@functools.cache
def _kernel(name: str):
    """``torch.ops.klear.<name>`` where the extension is built, else None."""
    try:
        from megatron_klear import _C  # noqa: F401 - registers torch.ops.klear
    except ImportError:
        return None
    return getattr(torch.ops.klear, name, None)


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether the extension's CPU kernels serve ``x`` (fp32 on the CPU)."""
    return x.dtype == torch.float32 and x.device.type == "cpu"


class KVCache:
    """Keys and values of every layer in buffers with spare capacity (keys transposed,
    [b, kv, d, capacity], values [b, kv, capacity, d]; doubled when full, in whole
    DECODE_BLOCKs), plus each row's additive padding mask over those positions. A step writes
    its positions in place: no per-step concatenation of the whole cache. The buffers live on
    ``valid``'s device (the model's)."""

    def __init__(self, config, valid: torch.Tensor, dtype: torch.dtype, capacity: int) -> None:
        self.device = valid.device
        self.layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.dtype, self.length = dtype, 0
        self.min = torch.finfo(dtype).min
        b = valid.shape[0]
        self.k = self.v = []
        self.bias = torch.zeros(b, 0, dtype=dtype, device=self.device)
        self._resize(max(capacity, valid.shape[1]))
        self.bias[:, :valid.shape[1]] = torch.where(valid.bool(), 0.0, self.min)

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before they grow."""
        return self.bias.shape[1]

    def _resize(self, capacity: int) -> None:
        b, held = self.bias.shape[0], self.length
        capacity = -(-capacity // DECODE_BLOCK) * DECODE_BLOCK
        new_k, new_v = ([torch.empty(shape, dtype=self.dtype, device=self.device)
                         for _ in range(self.layers)]
                        for shape in ((b, self.kv_heads, self.head_dim, capacity),
                                      (b, self.kv_heads, capacity, self.head_dim)))
        for old, new in zip(self.k, new_k):
            new[..., :held] = old[..., :held]
        for old, new in zip(self.v, new_v):
            new[:, :, :held] = old[:, :, :held]
        # later positions: generated, valid
        bias = torch.zeros(b, capacity, dtype=self.dtype, device=self.device)
        bias[:, :self.bias.shape[1]] = self.bias[:, :capacity]
        self.k, self.v, self.bias = new_k, new_v, bias

    def reserve(self, end: int) -> None:
        if end > self.bias.shape[1]:
            self._resize(2 * end)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's keys/values ([b, kv, t, d]) at ``length`` (keys transposed)."""
        end = self.length + key.shape[2]
        self.k[layer][..., self.length:end] = key.transpose(2, 3)
        self.v[layer][:, :, self.length:end] = value

    def attend(self, layer: int, query: torch.Tensor, mask: torch.Tensor, scaling: float
               ) -> torch.Tensor:
        """``query`` [b, h, t, d] against the layer's filled cache (after :meth:`append`):
        [b, t, h * d]. A one-token step of an fp32 CPU cache runs the decode kernel."""
        b, h, t, d = query.shape
        end = self.length + t
        kernel = _kernel("decode_attention") if t == 1 and _on_kernels(query) else None
        if kernel is None:
            return grouped_attention(query, self.k[layer][..., :end],
                                     self.v[layer][:, :, :end], mask, scaling)
        out = kernel(query.reshape(b, h, d), self.k[layer], self.v[layer], self.bias, end,
                     scaling)
        return out.view(b, 1, h * d)

    def mask(self, steps: int) -> torch.Tensor:
        """The additive mask [b, 1, steps, length + steps]: padding, and causal within the
        new positions."""
        end = self.length + steps
        pad = self.bias[:, None, None, :end]
        if steps == 1:
            return pad
        causal = torch.ones(steps, end, dtype=torch.bool, device=self.device).tril(self.length)
        return torch.where(causal, pad, self.min)

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (the n samples of a prompt share its prefill)."""
        index = index.to(self.device)
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]
        self.bias = self.bias.index_select(0, index)


def _attention_inputs(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, b: int, fused_rope: bool = True
                      ) -> tuple[torch.Tensor, ...]:
    """The layer's queries, keys and values [b, heads, t, d] of its projections ``q``, ``k``,
    ``v`` [b * t, heads * d]: queries and keys each head RMS-normed (q_norm / k_norm) and
    rotated (``apply_rotary_pos_emb``; ``cos``/``sin`` [b, t, d]), for an fp32 CPU model in one
    ``klear::qk_norm_rope`` pass per tensor unless ``fused_rope`` is False: the separate norm
    and rotation then round as megatron's q/k layernorm and rotary embedding do (the fused
    pass differs from them by 1-2 ulp, the only op of the forward that does, docs/rollout.md)."""
    t, d = q.shape[0] // b, attn.head_dim
    q, k, v = (y.view(b, t, -1, d) for y in (q, k, v))
    kernel = _kernel("qk_norm_rope") if fused_rope and _on_kernels(q) else None
    if kernel is None:
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        q, k = (_norm(norm, y).transpose(1, 2) for norm, y in ((attn.q_norm, q), (attn.k_norm, k)))
        return (*apply_rotary_pos_emb(q, k, cos, sin), v.transpose(1, 2))
    cos, sin = cos.reshape(b * t, d), sin.reshape(b * t, d)
    q, k = (kernel(y.view(b * t, -1, d), norm.weight, cos, sin, norm.variance_epsilon)
            .view(b, t, -1, d).transpose(1, 2) for norm, y in ((attn.q_norm, q), (attn.k_norm, k)))
    return q, k, v.transpose(1, 2)


class FusedWeights:
    """Each layer's q|k|v and (dense MLP) gate|up weights concatenated, so that a step runs
    one GEMM for each instead of three and two: oneDNN's cost per call is larger than MKL's
    and loses on the small k and v projections alone, while a 64-row step's projections take
    about 0.5 ms fused through oneDNN against 0.75-0.8 ms unfused through MKL
    (benchmarks/bench_cpu_gemm.py). A copy of the weights when built: the generator builds a
    new one after every weight change (Generator._weights_changed)."""

    def __init__(self, model: torch.nn.Module) -> None:
        def cat(modules: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
            bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
            return torch.cat([m.weight for m in modules]), bias

        self.qkv, self.gate_up = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(cat((attn.q_proj, attn.k_proj, attn.v_proj)))
            self.gate_up.append(cat((mlp.gate_proj, mlp.up_proj))
                                if hasattr(mlp, "gate_proj") else None)


def _linear(module: torch.nn.Module, x: torch.Tensor, linear: Callable = F.linear
             ) -> torch.Tensor:
    """An ``nn.Linear`` of the model applied as ``linear`` (``F.linear`` or oneDNN's): a decode
    step makes ~30 such calls, and the module call costs more than a 64-row projection of a
    tiny model."""
    return linear(x, module.weight, module.bias)


def _qkv(attn: torch.nn.Module, x: torch.Tensor, fused: tuple | None, linear: Callable
         ) -> tuple[torch.Tensor, ...]:
    """The layer's q, k and v projections of ``x`` [rows, hidden]: one GEMM of the ``fused``
    weights where given, else one per projection module."""
    if fused is None:
        return tuple(_linear(p, x, linear) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    kv = attn.k_proj.weight.shape[0]
    return linear(x, *fused).split([fused[0].shape[0] - 2 * kv, kv, kv], dim=-1)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor, fused: tuple | None, linear: Callable
         ) -> torch.Tensor:
    """The layer's MLP: transformers' ``Qwen3MLP`` (``down(act(gate(x)) * up(x))``), gate and
    up as one GEMM of the ``fused`` weights where given; a sparse-MoE block is called as the
    module (its router hooks record routed experts)."""
    if not hasattr(mlp, "gate_proj"):
        return mlp(x[None])[0]  # a batch of one sequence: the block routes each token alone
    if fused is None:
        gate, up = _linear(mlp.gate_proj, x, linear), _linear(mlp.up_proj, x, linear)
    else:
        gate, up = linear(x, *fused).chunk(2, dim=-1)
    return _linear(mlp.down_proj, mlp.act_fn(gate) * up, linear)


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm as one fused ``rms_norm``: fp32 statistics as transformers' module (in
    bf16 it rounds once where the module rounds twice, within a bf16 ulp); for an fp32 CPU
    model the extension's ``klear::rms_norm``."""
    return rms_norm(x, module.weight, module.variance_epsilon)


def _step_linear(x: torch.Tensor, fused: FusedWeights | None) -> Callable:
    """The projections' GEMM for a forward of ``x`` [rows, hidden]: oneDNN's for a one-token
    step of at least ONEDNN_MIN_ROWS fp32 CPU rows with fused weights, else ``F.linear``
    (a prefill's row count differs every batch, and oneDNN builds a kernel per shape)."""
    onednn = platform.onednn_linear() if fused is not None and _on_kernels(x) else None
    return onednn if onednn is not None and x.shape[0] >= ONEDNN_MIN_ROWS else F.linear


@torch.no_grad()
def forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
            cache: KVCache, all_logits: bool = False, fused: FusedWeights | None = None,
            fused_rope: bool = True) -> torch.Tensor:
    """fp32 logits of ``ids`` [b, t] at ``positions`` [b, t], appended to ``cache``: of every
    position with ``all_logits``, else of the last only ([b, t or 1, V]). ``fused``: the
    model's current weights fused (:class:`FusedWeights`); one-token steps then run their
    projections through oneDNN. ``fused_rope`` False: q/k norm and rotary embedding as
    separate ops (:func:`_attention_inputs`)."""
    inner = model.model
    b, t = ids.shape
    cache.reserve(cache.length + t)
    mask = cache.mask(t)
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    hidden = hidden.view(b * t, -1)  # the projections see 2-D token rows
    linear = _step_linear(hidden, fused) if t == 1 else F.linear
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        projected = _qkv(attn, _norm(layer.input_layernorm, hidden),
                         fused.qkv[i] if fused else None, linear)
        q, k, v = _attention_inputs(attn, *projected, cos, sin, b, fused_rope)
        cache.append(i, k, v)
        attended = cache.attend(i, q, mask, attn.scaling).view(b * t, -1)
        hidden = hidden + _linear(attn.o_proj, attended, linear)
        hidden = hidden + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, hidden),
                               fused.gate_up[i] if fused else None, linear)
    cache.length += t
    hidden = hidden.view(b, t, -1)
    hidden = _norm(inner.norm, hidden if all_logits else hidden[:, -1:])
    return _linear(model.lm_head, hidden, linear).float()
