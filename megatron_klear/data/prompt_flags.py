"""The prompt flags every CLI shares (klear-rl, klear-sft, klear-eval), and the pre-flight
check of a data file.

:class:`TemplateFlags` (chat-template arguments) is shared by the three; :class:`PromptFlags`
(prompt and label fields, prompt rendering) by klear-rl and klear-eval, which render prompts
for generation. Same flag names, defaults and checks everywhere (config.py's sections).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from megatron_klear.config import ConfigError, Section, opt
from megatron_klear.data.prompts import ANSWER_FORMATS, PROMPT_TEMPLATES, DataError, \
    load_prompt_dataset, parse_chat_template_kwargs

__all__ = ["TemplateFlags", "PromptFlags", "FIRST_RECORDS", "check_data_file",
           "check_prompt_file"]

# records of each data file parsed before a run builds anything (the whole file is read
# when the run loads it)
FIRST_RECORDS = 32


@dataclass
class TemplateFlags(Section):
    """Arguments of the chat template for every rendering."""

    title = "chat template"
    chat_template_kwargs: str | None = opt(None, "JSON object of chat-template arguments for "
                                           "every rendering, e.g. '{\"enable_thinking\": "
                                           "false}' (Qwen3's non-thinking mode)")

    def validate_section(self) -> None:  # noqa: D102
        parse_chat_template_kwargs(self.chat_template_kwargs)


@dataclass
class PromptFlags(TemplateFlags):
    """The fields of a prompt record and how a prompt is rendered for generation."""

    title = "prompts"
    prompt_key: str = opt("prompt", "prompt field")
    answer_key: str = opt("answer", "label field (answer for math, tests for code)")
    answer_format: str | None = opt(None, "label extraction, e.g. gsm8k ('#### N')")
    prompt_template: str | None = opt(None, "prompt rendering: chat (the tokenizer's chat "
                                      "template) or raw text; default chat when the tokenizer "
                                      "has a template, else raw", choices=PROMPT_TEMPLATES)
    chat_template: str | None = opt(None, "Jinja chat template file replacing the tokenizer's")

    def validate_section(self) -> None:  # noqa: D102
        if self.answer_format is not None and self.answer_format not in ANSWER_FORMATS:
            raise ConfigError(f"--answer-format {self.answer_format!r}: choose one of "
                              f"{list(ANSWER_FORMATS)}")
        if self.chat_template and self.prompt_template == "raw":
            raise ConfigError("--chat-template is used only with --prompt-template chat; drop "
                              "one of them")

    def check_inputs_section(self, model: Any) -> None:  # noqa: D102
        if self.chat_template and not os.path.isfile(self.chat_template):
            raise ConfigError(f"--chat-template {self.chat_template}: no such file (a Jinja "
                              "chat template)")

    def check_prompts(self, flag: str, path: str) -> None:
        """The prompt file of ``flag`` with these fields: :func:`check_prompt_file`."""
        check_prompt_file(flag, path, prompt_key=self.prompt_key, answer_key=self.answer_key,
                          answer_format=self.answer_format)


def check_data_file(flag: str, path: str | None) -> None:
    """``flag``'s file exists, and a JSONL file's last line is whole (a copy cut short)."""
    if not path:
        raise ConfigError(f"{flag} is required")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    if str(path).endswith(".jsonl"):
        _check_last_line(path)


def check_prompt_file(flag: str, path: str | None, **keys: Any) -> None:
    """``flag``'s prompt file exists and its first :data:`FIRST_RECORDS` records parse as
    prompts with labels (``keys``: load_prompt_dataset's field flags); :class:`DataError`
    at FILE:LINE on a bad record."""
    check_data_file(flag, path)
    load_prompt_dataset(path, limit=FIRST_RECORDS, **keys)


def _check_last_line(path: str) -> None:
    """The last non-empty line of a JSONL file parses (the lines between are parsed only
    when the run loads the file)."""
    last, last_no = b"", 0
    with open(path, "rb") as f:
        for no, line in enumerate(f, 1):
            if line.strip():
                last, last_no = line, no
    if not last_no:
        return
    try:
        json.loads(last)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}:{last_no}: invalid JSON ({getattr(exc, 'msg', exc)}); is the "
                        "file cut short?") from None
