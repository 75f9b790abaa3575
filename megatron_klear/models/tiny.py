"""Tiny Qwen3 models and a character-level tokenizer, built locally (no downloads).

Used by the tests, the benchmarks and the CPU quickstart. The tokenizer is a real
``transformers.PreTrainedTokenizerFast`` with a Qwen-style chat template, so every code
path (chat templates, special tokens, decoding) is the one used with real Qwen3 models.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# CHAT_TEMPLATE with Qwen3's tool parts, compact for a character-level tokenizer (every
# character is a token): the tools go into a system turn as `name: parameters` (Qwen3 lists
# each schema's JSON), an assistant message's tool_calls follow its content as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the hermes parser's format,
# rollout/orchestration/tool_calls.py), and role `tool` messages become user turns of <tool_response> blocks.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}"
    "{% set f = t.function if t.function else t %}{{ '; ' if not loop.first }}{{ f.name }}: "
    "{{ (f.parameters.properties if f.parameters else {}) | list | join(', ') }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>"
    "{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{% set f = c.function if c.function else c %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3_config(vocab_size: int = 300, **overrides: Any) -> dict:
    """An HF ``config.json`` dict of a tiny dense Qwen3 (GQA 4/2 heads, QK-norm, SwiGLU)."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def tiny_qwen3_moe_config(vocab_size: int = 300, **overrides: Any) -> dict:
    """An HF ``config.json`` dict of a tiny Qwen3-MoE: 4 layers, 4 experts, top-2 with
    renormalised weights, layer 1 dense (``mlp_only_layers``) so both MLP kinds are used."""
    cfg = tiny_qwen3_config(vocab_size, architectures=["Qwen3MoeForCausalLM"],
                            model_type="qwen3_moe", num_hidden_layers=4, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                            router_aux_loss_coef=0.001, output_router_logits=False)
    cfg.update(overrides)
    return cfg


def build_tokenizer(out_dir: str | Path | None = None, chat_template: str = CHAT_TEMPLATE):
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII plus Qwen specials
    (``chat_template``: :data:`CHAT_TEMPLATE`, or :data:`TOOL_CHAT_TEMPLATE` for tools)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=chat_template,
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def save_tiny_hf_model(out_dir: str | Path, *, seed: int = 0, std: float = 0.02,
                       with_tokenizer: bool = True, moe: bool = False,
                       chat_template: str = CHAT_TEMPLATE, **config_overrides: Any) -> Path:
    """Write a randomly initialised tiny Qwen3 HF checkpoint (safetensors + config) to ``out_dir``.

    ``std`` > 0.02 (e.g. 0.2) with random norm weights makes parity tests sensitive to
    any mapping error. ``moe``: a tiny Qwen3-MoE (:func:`tiny_qwen3_moe_config`) instead.
    ``chat_template``: the tokenizer's (:func:`build_tokenizer`).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir if with_tokenizer else None, chat_template)
    overrides = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}
    overrides.update(config_overrides)
    make_config = tiny_qwen3_moe_config if moe else tiny_qwen3_config
    cfg = (Qwen3MoeConfig if moe else Qwen3Config)(**make_config(**overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if std > 0.02 else torch.ones_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # Keep config.json minimal and stable across transformers versions.
    (out_dir / "config.json").write_text(json.dumps(make_config(**overrides), indent=2))
    return out_dir
