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


def build_tokenizer(out_dir: str | Path | None = None):
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII plus Qwen specials."""
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
        additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=CHAT_TEMPLATE,
    )
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def save_tiny_hf_model(out_dir: str | Path, *, seed: int = 0, std: float = 0.02,
                       with_tokenizer: bool = True, **config_overrides: Any) -> Path:
    """Write a randomly initialised tiny Qwen3 HF checkpoint (safetensors + config) to ``out_dir``.

    ``std`` > 0.02 (e.g. 0.2) with random norm weights makes parity tests sensitive to
    any mapping error.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir if with_tokenizer else None)
    overrides = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}
    overrides.update(config_overrides)
    cfg = Qwen3Config(**tiny_qwen3_config(**overrides))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if std > 0.02 else torch.ones_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # Keep config.json minimal and stable across transformers versions.
    (out_dir / "config.json").write_text(json.dumps(tiny_qwen3_config(**overrides), indent=2))
    return out_dir
