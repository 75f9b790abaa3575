"""Long-CoT SFT data: chat records -> token ids with a response-only loss mask.

A record is either ``{"prompt": str, "response": str}`` or ``{"messages": [...]}`` (loss on
every assistant turn). Field names are configurable. Sequences longer than the bin are
truncated or dropped (``overflow``), and the counts are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_klear.data.prompts import DataError, load_records


@dataclass
class SFTSample:
    """One tokenised conversation; ``loss_mask[i]`` is 1 where token i is a response token."""

    index: int
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class SFTStats:
    """What loading did to the data (reported to the user)."""

    loaded: int = 0
    truncated: int = 0
    dropped: int = 0
    lengths: list[int] = field(default_factory=list)


def _messages(rec: dict, where: str, prompt_key: str, response_key: str,
              messages_key: str) -> list[dict]:
    if messages_key in rec:
        msgs = rec[messages_key]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise DataError(f"{where}: field {messages_key!r} must be a non-empty list of "
                            "{'role', 'content'} messages")
        if not any(m["role"] == "assistant" and str(m["content"]).strip() for m in msgs):
            raise DataError(f"{where}: no non-empty assistant message to train on")
        return msgs
    for key, flag in ((prompt_key, "--prompt-key"), (response_key, "--response-key")):
        if key not in rec:
            raise DataError(f"{where}: missing field {key!r} (set {flag} or --messages-key)")
    if not str(rec[response_key]).strip():
        raise DataError(f"{where}: empty response in field {response_key!r}")
    return [{"role": "user", "content": str(rec[prompt_key])},
            {"role": "assistant", "content": str(rec[response_key])}]


def tokenize_conversation(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask over assistant-turn tokens.

    Each segment is tokenised on its own, so the mask boundaries are exact: the context up
    to an assistant turn (generation prompt included) is 0, the turn itself is 1.
    """
    ids: list[int] = []
    mask: list[int] = []
    done = ""

    def add(text: str, label: int) -> None:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(seg)
        mask.extend([label] * len(seg))

    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            ctx = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                add_generation_prompt=True)
            add(ctx[len(done):], 0)
            done = ctx
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        add(full[len(done):], int(msg["role"] == "assistant"))
        done = full
    return ids, mask


def load_sft_dataset(path: str | Path, tokenizer: Any, *, max_length: int,
                     prompt_key: str = "prompt", response_key: str = "response",
                     messages_key: str = "messages", overflow: str = "truncate",
                     ) -> tuple[list[SFTSample], SFTStats]:
    """Tokenise every record of a JSONL/Parquet file; sequences fit in ``max_length`` tokens."""
    if overflow not in ("truncate", "drop"):
        raise DataError(f"--overflow must be 'truncate' or 'drop', got {overflow!r}")
    samples: list[SFTSample] = []
    stats = SFTStats()
    for line, rec in load_records(path):
        where = f"{path}:{line}"
        ids, mask = tokenize_conversation(
            tokenizer, _messages(rec, where, prompt_key, response_key, messages_key))
        stats.lengths.append(len(ids))
        if len(ids) > max_length:
            if overflow == "drop":
                stats.dropped += 1
                continue
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask[1:]) == 0:
            stats.dropped += 1  # nothing left to learn after truncation
            continue
        samples.append(SFTSample(len(samples), ids, mask))
    stats.loaded = len(samples)
    if not samples:
        raise DataError(f"{path}: no usable samples (loaded 0, dropped {stats.dropped})")
    return samples, stats
