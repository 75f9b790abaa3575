"""Long-CoT SFT data: chat records -> token ids with a response-only loss mask.

A record is either ``{"prompt": str | chat list, "response": str}`` or ``{"messages": [...]}``
(loss on every assistant turn; ``--sft-multi-turn per-turn``: one sample per assistant turn,
see :func:`conversation_samples`). Messages may be tool trajectories: assistant turns with
``tool_calls`` (OpenAI layout, content empty or null), role ``tool`` responses, and a
record-level ``tools`` list of JSON schemas that the chat template renders
(``apply_chat_template(..., tools=...)``); tool responses are masked like other messages. Field names are configurable and may be dotted paths into
nested fields (``extra_info.response``). The token ids are the tokenisation of the chat
template's rendering of the whole conversation; the loss mask covers the assistant turns as
they appear in it (see :func:`tokenize_conversation`). Sequences longer than the bin are
truncated or dropped (``overflow``), and the counts are reported.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_klear.data.prompts import DataError, chat_prompt, chat_template_kwargs, \
    load_records, record_field

# appended to assistant contents to find where each one ends in the rendering
_MARK = "[[klear:end-of-message-{}]]"


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


def _tool_calls(calls: Any, where: str) -> None:
    """``tool_calls`` of an assistant message: a list of ``{"function": {"name", "arguments"}}``
    (or the bare ``{"name", "arguments"}``), arguments an object or its JSON text."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}: 'tool_calls' must be a non-empty list of calls")
    for call in calls:
        f = call.get("function", call) if isinstance(call, dict) else None
        args = f.get("arguments") if isinstance(f, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]
                and isinstance(args, dict)):
            raise DataError(f"{where}: each tool call needs a 'name' and 'arguments' (a JSON "
                            f"object or its text), got {json.dumps(call)[:80]}")


def _message(m: Any, where: str) -> dict:
    """One checked message; an assistant message with ``tool_calls`` may have no content
    (OpenAI's null), which becomes ''."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise DataError(f"{where}: each message must be an object with a 'role'")
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        _tool_calls(m["tool_calls"], where)
        if m.get("content") is None:
            return dict(m, content="")
    if "content" not in m or (m["role"] == "assistant" and not isinstance(m["content"], str)):
        raise DataError(f"{where}: {m['role']!r} messages need a 'content'"
                        + (" string (or 'tool_calls')" if m["role"] == "assistant" else ""))
    return m


def _messages(rec: dict, where: str, prompt_key: str, response_key: str,
              messages_key: str) -> list[dict]:
    msgs = record_field(rec, messages_key)
    if msgs is not None:
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: field {messages_key!r} must be a non-empty list of "
                            "{'role', 'content'} messages")
        msgs = [_message(m, f"{where}: message {i}") for i, m in enumerate(msgs)]
        if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls"))
                   for m in msgs):
            raise DataError(f"{where}: no non-empty assistant message to train on")
        return msgs
    prompt, response = record_field(rec, prompt_key), record_field(rec, response_key)
    for key, flag, value in ((prompt_key, "--prompt-key", prompt),
                             (response_key, "--response-key", response)):
        if value is None:
            raise DataError(f"{where}: missing field {key!r} (set {flag} or --messages-key)")
    if not str(response).strip():
        raise DataError(f"{where}: empty response in field {response_key!r}")
    return [*chat_prompt(prompt, where, prompt_key),
            {"role": "assistant", "content": str(response)}]


def _record_tools(rec: dict, where: str) -> list[dict] | None:
    """The record's ``tools``: JSON schemas for the chat template (None without)."""
    tools = rec.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: field 'tools' must be a list of tool JSON schemas (objects), "
                        "as the chat template takes them")
    return tools


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool,
            kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **kwargs)
    except Exception as exc:  # jinja errors, raise_exception() of the template
        raise DataError(f"the chat template fails on this conversation "
                        f"({type(exc).__name__}: {exc})") from None


def _once(text: str, mark: str, what: str) -> int:
    count = text.count(mark)
    if count != 1:
        raise DataError(f"ambiguous loss mask: {what} appears {count} times in the rendering "
                        "(the template drops or repeats it)")
    return text.index(mark)


def _content_ends(tokenizer: Any, messages: list[dict], turns: list[int], full: str,
                  kwargs: dict) -> dict[int, int]:
    """Where each assistant turn's content ends in ``full``: a marker is appended to every
    assistant content (before its trailing whitespace, which trimming templates drop) and
    the marked rendering, markers removed, must be ``full`` again."""
    marked = [dict(m) for m in messages]
    for i in turns:
        content = messages[i]["content"]
        body = content.rstrip()
        marked[i]["content"] = body + _MARK.format(i) + content[len(body):]
    text = _render(tokenizer, marked, False, kwargs)
    found = sorted((_once(text, _MARK.format(i), f"assistant message {i}"), i) for i in turns)
    ends, shift = {}, 0
    for pos, i in found:
        ends[i] = pos - shift
        shift += len(_MARK.format(i))
    for i in turns:
        text = text.replace(_MARK.format(i), "")
    if text != full:
        raise DataError("ambiguous loss mask: the template rewrites the end of an assistant "
                        "message (marking where it ends changes the rendering)")
    return ends


def _turn_start(tokenizer: Any, messages: list[dict], i: int, full: str, kwargs: dict) -> int:
    """End of the generation prompt before assistant message ``i`` in ``full``: the
    rendering of the messages before it plus the generation prompt must be a prefix of
    ``full``, or else (the template renders earlier messages differently once later ones
    follow: Qwen3 drops the reasoning of turns before the last user query) the text the
    generation prompt adds after message ``i - 1`` must follow that message's content in
    ``full`` (:func:`_start_after`). With template arguments, the prompt without them is
    tried second: Qwen3 renders earlier turns without the empty think block of
    ``enable_thinking: false``. The record's ``tools`` stay in both."""
    bare = {"tools": kwargs["tools"]} if "tools" in kwargs else {}
    candidates = []
    for args in ([kwargs, bare] if kwargs != bare else [kwargs]):
        try:
            prompt = _render(tokenizer, messages[:i], True, args)
        except DataError:
            if args is kwargs:
                raise
            break  # the template needs its arguments: no second candidate
        if full.startswith(prompt):
            return len(prompt)
        candidates.append(args)
    for args in candidates:
        start = _start_after(tokenizer, messages, i, full, args, kwargs)
        if start is not None:
            return start
    raise DataError(f"ambiguous loss mask: the start of assistant message {i} is not found: "
                    "neither do the messages before it plus the generation prompt render as "
                    "the start of the whole conversation, nor does the generation prompt "
                    f"follow message {i - 1} in it (the template renders them differently "
                    "when this message follows)")


def _start_after(tokenizer: Any, messages: list[dict], i: int, full: str, args: dict,
                 kwargs: dict) -> int | None:
    """End of the generation prompt before assistant message ``i`` in ``full``, anchored on
    the content of message ``i - 1`` (a user, tool or system message): a marker appended to
    it finds it in the whole rendering (which, markers removed, must be ``full`` again) and
    in the rendering of the messages up to it plus the generation prompt (``args``); the text
    after the marker there must follow it in ``full``. None where it does not."""
    prev = i - 1
    if prev < 0 or messages[prev]["role"] == "assistant" \
            or not isinstance(messages[prev].get("content"), str):
        return None
    mark = _MARK.format(prev)
    marked = dict(messages[prev], content=messages[prev]["content"] + mark)
    prompt = _render(tokenizer, messages[:prev] + [marked], True, args)
    whole = _render(tokenizer, messages[:prev] + [marked] + messages[i:], False, kwargs)
    if prompt.count(mark) != 1 or whole.count(mark) != 1 or whole.replace(mark, "") != full:
        return None
    glue = prompt[prompt.index(mark) + len(mark):]
    at = whole.index(mark)
    return at + len(glue) if whole.startswith(glue, at + len(mark)) else None


def _turn_end(tokenizer: Any, messages: list[dict], i: int, full: str, content_end: int,
              kwargs: dict) -> int:
    """End of assistant message ``i`` in ``full``: its content, then the text the template
    closes an assistant turn with (learnt from the turn rendered as the last message)."""
    closing = _closing(tokenizer, messages, i, kwargs)
    content = messages[i]["content"]
    tail = content[len(content.rstrip()):]
    for end in dict.fromkeys((content_end + len(tail), content_end)):
        if full.startswith(tail[:end - content_end], content_end) \
                and full.startswith(closing, end):
            return end + len(closing)
    raise DataError(f"ambiguous loss mask: assistant message {i} is not followed by the "
                    f"template's end of turn {closing!r} in the rendering")


def _closing(tokenizer: Any, messages: list[dict], i: int, kwargs: dict) -> str:
    """The text the template closes assistant message ``i`` with, learnt from a probe: the
    messages before it and a marker message, without tool calls, as the last message. The
    newline the template writes after the end-of-turn token is trained with the turn (the
    tiny ``--tools`` quickstart's SFT fails without it: docs/results.md, CPU quickstart)."""
    mark = _MARK.format(i)
    probe_msg = {k: v for k, v in messages[i].items() if k != "tool_calls"}
    probe = _render(tokenizer, messages[:i] + [dict(probe_msg, content=mark)], False, kwargs)
    return probe[_once(probe, mark, "a probe assistant message") + len(mark):]


def _tool_turn_end(tokenizer: Any, messages: list[dict], i: int, full: str, start: int,
                   kwargs: dict) -> int:
    """End of assistant message ``i`` with ``tool_calls`` in ``full``: the first end of turn
    (as :func:`_closing`) after its generation prompt. The calls are rendered after the
    content, so no marker can end them (and a marker in an empty content changes the
    rendering: Qwen3 puts a newline before a call that follows content); instead the turn's
    own text must not hold the end of turn, which makes the first one its end."""
    closing = _closing(tokenizer, messages, i, kwargs)
    own = messages[i]["content"] + str(messages[i].get("reasoning_content") or "") \
        + json.dumps(messages[i]["tool_calls"], ensure_ascii=False)
    if not closing.strip() or closing.strip() in own:
        raise DataError(f"ambiguous loss mask: assistant message {i} contains the template's "
                        f"end of turn {closing.strip()!r} (or the template has none)")
    end = full.find(closing, start)
    names = [c.get("function", c)["name"] for c in messages[i]["tool_calls"]]
    if end < 0 or not all(n in full[start:end] for n in names):
        raise DataError(f"the tool calls {names} of assistant message {i} are not rendered "
                        f"before the template's end of turn {closing!r}: the model's chat "
                        "template (its tokenizer_config.json) must render 'tool_calls'")
    return end + len(closing)


def assistant_spans(tokenizer: Any, messages: list[dict], kwargs: dict | None = None,
                    turns: list[int] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of the whole conversation and the character span of every assistant
    turn in it (or of the assistant messages ``turns``), from the end of its generation
    prompt to the end of its turn (end-of-turn token included; a turn's ``tool_calls`` as the
    template renders them are in it, the ``tool`` messages after it are not; the reasoning
    the template shows is in it, the reasoning it drops is not). ``kwargs``: chat template
    arguments, with the record's ``tools`` under ``"tools"``. Raises :class:`DataError` where
    the template makes a span ambiguous."""
    kwargs = kwargs or {}
    full = _render(tokenizer, messages, False, kwargs)
    if turns is None:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    called = {i for i in turns if messages[i].get("tool_calls")}
    for i in turns:
        if not isinstance(messages[i]["content"], str):
            raise DataError(f"assistant message {i}: content must be a string")
        if "[[klear:" in messages[i]["content"]:
            raise DataError(f"assistant message {i} contains the reserved text '[[klear:'")
    ends = _content_ends(tokenizer, messages, [i for i in turns if i not in called], full,
                         kwargs)
    spans: list[tuple[int, int]] = []
    for i in turns:
        start = _turn_start(tokenizer, messages, i, full, kwargs)
        if i in called:
            ends[i] = start
            end = _tool_turn_end(tokenizer, messages, i, full, start, kwargs)
        else:
            end = _turn_end(tokenizer, messages, i, full, ends[i], kwargs)
        if not (spans[-1][1] if spans else 0) <= start <= ends[i] <= end:
            raise DataError(f"ambiguous loss mask: assistant message {i} overlaps the turn "
                            "before it or its generation prompt")
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], kwargs: dict | None = None,
                          tools: list[dict] | None = None, turns: list[int] | None = None
                          ) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and a mask over its assistant turns.

    The ids are the tokenisation of the template's rendering of the whole conversation
    (history as the template shows it: Qwen3 drops the reasoning of earlier turns); the mask
    is 1 on exactly the tokens of the assistant turns as they appear there (see
    :func:`assistant_spans`), 0 on generation prompts and other messages. ``kwargs``: chat
    template arguments (default: the tokenizer's ``--chat-template-kwargs``); ``tools``: the
    record's tool schemas, passed to the template; ``turns``: only these assistant messages
    are trained (default: all). A token that straddles a span boundary is an error, never a
    guess.
    """
    kwargs = chat_template_kwargs(tokenizer) if kwargs is None else dict(kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    full, spans = assistant_spans(tokenizer, messages, kwargs, turns)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("SFT needs a fast tokenizer (character offsets to place the loss mask)")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for a, b in enc["offset_mapping"]:
        inside = any(s <= a and b <= e for s, e in spans)
        if not inside and any(a < e and s < b for s, e in spans):
            raise DataError(f"ambiguous loss mask: token {full[a:b]!r} straddles the start or "
                            "end of an assistant turn")
        mask.append(int(inside))
    return list(enc["input_ids"]), mask


MULTI_TURN = ("whole", "per-turn")


def conversation_samples(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                         multi_turn: str = "whole") -> list[tuple[list[int], list[int]]]:
    """The (ids, loss mask) samples of one conversation under ``--sft-multi-turn``:
    ``whole``: one sample, every assistant turn trained as the whole conversation renders it
    (Qwen3 drops the reasoning of turns before the last user query, so it is not trained);
    ``per-turn``: one sample per assistant turn, the conversation up to it rendered as at
    generation time (the turn last, its reasoning shown), only that turn trained."""
    if multi_turn == "whole":
        return [tokenize_conversation(tokenizer, messages, tools=tools)]
    return [tokenize_conversation(tokenizer, messages[:i + 1], tools=tools, turns=[i])
            for i, m in enumerate(messages) if m["role"] == "assistant"]


def check_sft_records(path: str | Path, limit: int, *, prompt_key: str = "prompt",
                      response_key: str = "response", messages_key: str = "messages") -> None:
    """The first ``limit`` records of an SFT file hold a conversation (no tokenizer needed:
    the pre-flight check of ``--data-path``); :class:`DataError` at FILE:LINE otherwise."""
    for line, rec in itertools.islice(load_records(path), limit):
        _messages(rec, f"{path}:{line}", prompt_key, response_key, messages_key)
        _record_tools(rec, f"{path}:{line}")


def load_sft_dataset(path: str | Path, tokenizer: Any, *, max_length: int,
                     prompt_key: str = "prompt", response_key: str = "response",
                     messages_key: str = "messages", overflow: str = "truncate",
                     multi_turn: str = "whole") -> tuple[list[SFTSample], SFTStats]:
    """Tokenise every record of a JSONL/Parquet file into samples (``multi_turn``: see
    :func:`conversation_samples`); sequences fit in ``max_length`` tokens."""
    if overflow not in ("truncate", "drop"):
        raise DataError(f"--overflow must be 'truncate' or 'drop', got {overflow!r}")
    if multi_turn not in MULTI_TURN:
        raise DataError(f"--sft-multi-turn must be one of {', '.join(MULTI_TURN)}, "
                        f"got {multi_turn!r}")
    samples: list[SFTSample] = []
    stats = SFTStats()
    for line, rec in load_records(path):
        where = f"{path}:{line}"
        try:
            tokenized = conversation_samples(
                tokenizer, _messages(rec, where, prompt_key, response_key, messages_key),
                _record_tools(rec, where), multi_turn)
        except DataError as exc:
            msg = str(exc)
            raise DataError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        for ids, mask in tokenized:
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
