"""Prompt datasets for RL and evaluation: JSONL or Parquet records -> chat messages + label.

The label is what the reward compares against: the answer text for math (``math``
reward), the tests dict for code (``code`` reward: HumanEval ``test``/``entry_point``
with the prompt as trusted ``context``, or ``inputs``/``outputs``[/``fn_name``]).
Missing fields raise ``DataError`` naming the file, the line and the flag that fixes it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_klear.config import ConfigError
from megatron_klear.rewards.livecodebench import BadTestCases, lcb_tests
from megatron_klear.rewards.text import last_boxed

ANSWER_FORMATS = ("gsm8k", "boxed")
PROMPT_TEMPLATES = ("chat", "raw")
# "raw": the message contents as they are (blank line between messages), no role markup and
# no generation prompt -- base-model ("zero") RL and evaluation on plain-text prompts. A chat
# list prompt renders the same way: its contents (system included) joined by blank lines.
RAW_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}"
                "{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}")
_META_KEYS = ("id", "idx", "task_id", "data_source", "source")
_KWARGS_ATTR = "klear_chat_template_kwargs"  # see set_chat_template_kwargs


class DataError(ValueError):
    """Bad or missing data; the message names the file and line (or row) and the fix."""


@dataclass
class PromptSample:
    """One prompt: ``index`` in the dataset, chat ``messages``, reward ``label``, ``meta``."""

    index: int
    messages: list[dict]
    label: Any
    meta: dict = field(default_factory=dict)


def _jsonl_records(path: str) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(rec).__name__}")
            yield line_no, rec


def _parquet_records(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            row += 1
            yield row, rec


def load_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each record of a .jsonl file, or (row number from 1,
    record) for a .parquet file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if path.endswith(".jsonl"):
        return _jsonl_records(path)
    if path.endswith(".parquet"):
        return _parquet_records(path)
    raise DataError(f"{path}: unsupported data file; use .jsonl or .parquet")


def _where(path: str, line: int) -> str:
    return f"{path}:{line}"


def record_field(rec: dict, key: str) -> Any:
    """The value of ``key`` in a record, None when absent. A dotted key walks nested fields
    (``reward_model.ground_truth``, ``extra_info.index``, as verl/slime Parquet files nest
    them) unless the record has a field of that exact name."""
    if key in rec:
        return rec[key]
    value: Any = rec
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def chat_prompt(prompt: Any, where: str, prompt_key: str) -> list[dict]:
    """A prompt field as chat messages: a string is one user message; a chat list
    (``[{"role": "user", "content": ...}]``, verl/slime/Klear releases) is used as it is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DataError(f"{where}: field '{prompt_key}' must be a string or a non-empty chat list "
                    "[{'role': str, 'content': str}, ...]")


def extract_answer(value: Any, answer_format: str | None, where: str) -> Any:
    """Apply ``answer_format``: 'gsm8k' keeps the number after '####' (commas dropped);
    'boxed' keeps the last \\boxed{} of a worked solution (MATH, minerva)."""
    if answer_format is None:
        return value
    if answer_format == "gsm8k":
        if not isinstance(value, str) or "####" not in value:
            raise DataError(f"{where}: answer has no '####' (drop --answer-format gsm8k?)")
        return value.rsplit("####", 1)[1].strip().replace(",", "")
    if answer_format == "boxed":
        boxed = last_boxed(value) if isinstance(value, str) else None
        if boxed is None:
            raise DataError(f"{where}: answer has no \\boxed{{}} (drop --answer-format boxed?)")
        return boxed
    raise DataError(f"unknown --answer-format {answer_format!r}; use one of {ANSWER_FORMATS}")


def code_tests(rec: dict) -> dict | None:
    """The tests dict of a code record, or None when the record has no test fields.
    Accepts APPS-style ``input_output`` JSON strings and LiveCodeBench rows
    (:mod:`megatron_klear.rewards.livecodebench`) too."""
    lcb = lcb_tests(rec)
    if lcb is not None:
        return lcb
    if isinstance(rec.get("test"), str) and isinstance(rec.get("entry_point"), str):
        tests = {"test": rec["test"], "entry_point": rec["entry_point"]}
        if isinstance(rec.get("prompt"), str):
            tests["context"] = rec["prompt"]  # trusted helpers some tests call (HumanEval/32)
        return tests
    src = rec.get("input_output", rec)
    if isinstance(src, str):
        try:
            src = json.loads(src)
        except json.JSONDecodeError:
            return None
    if isinstance(src, dict) and isinstance(src.get("inputs"), list) \
            and isinstance(src.get("outputs"), list):
        tests = {"inputs": src["inputs"], "outputs": src["outputs"]}
        if src.get("fn_name"):
            tests["fn_name"] = src["fn_name"]
        return tests
    return None


def _messages(rec: dict, where: str, prompt_key: str, messages_key: str | None,
              system_prompt: str | None) -> list[dict]:
    if messages_key is not None:
        msgs = record_field(rec, messages_key)
        if msgs is None:
            raise DataError(f"{where}: missing field '{messages_key}' (set --messages-key ...)")
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs):
            raise DataError(f"{where}: field '{messages_key}' must be a list of "
                            "{'role': str, 'content': str}")
        msgs = [dict(m) for m in msgs]
    else:
        prompt = record_field(rec, prompt_key)
        if prompt is None:
            raise DataError(f"{where}: missing field '{prompt_key}' (set --prompt-key ... "
                            "or --messages-key ...)")
        msgs = chat_prompt(prompt, where, prompt_key)
    if system_prompt is not None and not (msgs and msgs[0]["role"] == "system"):
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def _label(rec: dict, where: str, answer_key: str, answer_format: str | None) -> Any:
    try:
        return _label_of(rec, where, answer_key, answer_format)
    except BadTestCases as exc:
        raise DataError(f"{where}: {exc}") from None


def _label_of(rec: dict, where: str, answer_key: str, answer_format: str | None) -> Any:
    value = record_field(rec, answer_key)
    if value is not None:
        if answer_format is None and (isinstance(value, dict) or (
                isinstance(value, str) and value.lstrip().startswith("{"))):
            tests = code_tests(value if isinstance(value, dict) else {"input_output": value})
            if tests is not None:  # --answer-key pointing at a tests field (APPS input_output)
                return tests
        return extract_answer(value, answer_format, where)
    tests = code_tests(rec)
    if tests is None:
        raise DataError(f"{where}: missing field '{answer_key}' (set --answer-key ...; code "
                        "records need 'test'+'entry_point' or 'inputs'+'outputs')")
    return tests


def tool_fields(rec: dict, where: str) -> dict:
    """A record's tools for multi-turn rollouts, as ``meta`` entries: ``tools`` (a list of
    tool names, the subset of ``--tools`` this prompt may call) and ``tools_kwargs`` (per tool
    name, arguments added to every call of it, e.g. a ground truth the model must not see),
    from top-level fields or verl's multi-turn layout (``extra_info.tools_kwargs``, with
    ``create_kwargs``/``execute_kwargs`` merged)."""
    out: dict = {}
    names = record_field(rec, "tools")
    if names is not None:
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise DataError(f"{where}: field 'tools' must be a list of tool names")
        out["tools"] = list(names)
    kwargs = record_field(rec, "tools_kwargs")
    if kwargs is None:
        kwargs = record_field(rec, "extra_info.tools_kwargs")
    if kwargs is not None:
        if not (isinstance(kwargs, dict) and all(isinstance(v, dict) for v in kwargs.values())):
            raise DataError(f"{where}: field 'tools_kwargs' must map tool names to objects")
        out["tools_kwargs"] = {name: {**(v.get("create_kwargs") or {}),
                                      **(v.get("execute_kwargs") or {})}
                               if {"create_kwargs", "execute_kwargs"} & set(v) else dict(v)
                               for name, v in kwargs.items()}
    return out


def load_prompt_dataset(path: str | os.PathLike, *, prompt_key: str = "prompt",
                        answer_key: str = "answer", messages_key: str | None = None,
                        system_prompt: str | None = None,
                        answer_format: str | None = None,
                        limit: int | None = None,
                        meta_keys: Sequence[str] = ()) -> list[PromptSample]:
    """All samples of a .jsonl/.parquet prompt file (see the module doc for labels), or its
    first ``limit`` (the pre-flight check of a run's data); ``meta_keys``: more record fields
    to keep in each sample's ``meta`` (dotted keys walk nested fields, :func:`record_field`),
    e.g. ``--opd-teacher-key``."""
    if answer_format is not None and answer_format not in ANSWER_FORMATS:
        raise DataError(f"unknown --answer-format {answer_format!r}; use one of {ANSWER_FORMATS}")
    path = os.fspath(path)
    samples = []
    for line, rec in itertools.islice(load_records(path), limit):
        where = _where(path, line)
        meta = {"file": path, "line": line, **{k: rec[k] for k in _META_KEYS if k in rec},
                **tool_fields(rec, where), **{k: record_field(rec, k) for k in meta_keys}}
        samples.append(PromptSample(len(samples), _messages(rec, where, prompt_key, messages_key,
                                                            system_prompt),
                                    _label(rec, where, answer_key, answer_format), meta))
    if not samples:
        raise DataError(f"{path}: no records")
    return samples


def set_prompt_template(tokenizer: Any, prompt_template: str | None = None,
                        chat_template: str | os.PathLike | None = None) -> str:
    """Choose how :func:`render_prompt` renders prompts with ``tokenizer``; returns the mode.

    ``chat_template`` (a Jinja file, ``--chat-template``) replaces the tokenizer's template.
    ``prompt_template`` (``--prompt-template``): ``chat`` renders through the chat template
    and fails with :class:`DataError` naming the flags when there is none; ``raw`` renders
    the message contents as plain text (installed as the tokenizer's template, so every
    caller of :func:`render_prompt` agrees); None picks ``chat`` when the tokenizer has a
    template, else ``raw`` with a one-line notice on stderr (rank 0).
    """
    if prompt_template not in (None, *PROMPT_TEMPLATES):
        raise DataError(f"--prompt-template {prompt_template!r}: choose one of {PROMPT_TEMPLATES}")
    if chat_template is not None:
        if prompt_template == "raw":
            raise DataError("--chat-template is used only with --prompt-template chat; drop one "
                            "of the two flags")
        path = Path(chat_template)
        if not path.is_file():
            raise DataError(f"--chat-template {path}: no such file (a Jinja chat template)")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_template is None:
        prompt_template = "chat" if has_template else "raw"
        if not has_template and os.environ.get("RANK", "0") == "0":
            print("notice: the tokenizer has no chat template, so prompts are rendered raw "
                  "(--prompt-template raw); pass --chat-template FILE to use one",
                  file=sys.stderr)
    if prompt_template == "chat" and not has_template:
        raise DataError("--prompt-template chat: the tokenizer has no chat template; pass "
                        "--chat-template FILE or use --prompt-template raw")
    if prompt_template == "raw":
        tokenizer.chat_template = RAW_TEMPLATE
    return prompt_template


def parse_chat_template_kwargs(value: str | dict | None,
                               flag: str = "--chat-template-kwargs") -> dict:
    """``--chat-template-kwargs``: a JSON object of chat-template arguments, e.g.
    ``'{"enable_thinking": false}'`` (Qwen3's non-thinking mode); ConfigError naming the flag
    otherwise."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {value!r}: invalid JSON ({exc.msg}); give a JSON object, "
                          "e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{flag} {value!r}: expected a JSON object of template arguments, "
                          "e.g. '{\"enable_thinking\": false}'")
    return parsed


def set_chat_template_kwargs(tokenizer: Any, kwargs: dict | None) -> None:
    """Template arguments every render with ``tokenizer`` passes (RL and eval prompts through
    :func:`render_prompt`, SFT records), kept with the tokenizer so that callers agree."""
    setattr(tokenizer, _KWARGS_ATTR, dict(kwargs or {}))


def chat_template_kwargs(tokenizer: Any) -> dict:
    """The template arguments set by :func:`set_chat_template_kwargs` (empty by default)."""
    return dict(getattr(tokenizer, _KWARGS_ATTR, None) or {})


def load_tokenizer(path: str | os.PathLike, prompt_template: str | None = None,
                   chat_template: str | os.PathLike | None = None,
                   chat_template_kwargs: dict | None = None) -> Any:
    """The HF tokenizer of ``path`` with its prompt rendering chosen
    (see :func:`set_prompt_template`) and its template arguments set."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((Path(path) / name).is_file() for name in names):
        # transformers would build an empty tokenizer from config.json alone: every prompt
        # would encode to no tokens
        raise DataError(f"{path}: no tokenizer files (none of {list(names)}); point at a "
                        "Hugging Face dir that has the model's tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(path))
    set_prompt_template(tokenizer, prompt_template, chat_template)
    set_chat_template_kwargs(tokenizer, chat_template_kwargs)
    return tokenizer


def render_prompt(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text the policy sees: the tokenizer's chat template with the generation
    prompt appended and the ``--chat-template-kwargs`` passed (the raw template when
    :func:`set_prompt_template` chose ``raw``)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **chat_template_kwargs(tokenizer))


def prompt_text(sample: PromptSample) -> str:
    """The user-visible text of a sample (all message contents), for n-gram checks."""
    return "\n".join(m["content"] for m in sample.messages if m["role"] != "system")

