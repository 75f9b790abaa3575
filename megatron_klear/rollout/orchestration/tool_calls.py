"""Tool calls in the model's own output format: parsers by name or import path.

A parser reads the text of one assistant turn and returns a :class:`ParsedTurn`: the text
outside the calls and the calls in order. A call the model wrote badly (malformed JSON, no
name, arguments that are not an object, an unclosed tag) is still returned, with ``error``
set: the rollout loop answers it with that error as the tool response, so a hostile or
clumsy model never crashes a step.

Built-in: ``hermes`` (alias ``qwen3``), the format of Qwen2.5/Qwen3 and Hermes models::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

Users add a parser with :func:`register_tool_parser` or name one by import path
(``pkg.mod:fn``, a function ``fn(text) -> ParsedTurn``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_klear.import_path import Registry

__all__ = ["ToolCall", "ParsedTurn", "parse_hermes", "register_tool_parser",
           "get_tool_parser"]


@dataclass
class ToolCall:
    """One call: the tool ``name`` and its ``arguments``, or ``error`` saying why the call
    could not be read (then name may be empty and arguments empty)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ParsedTurn:
    """An assistant turn: ``content`` (text outside the calls, stripped) and its calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes_call(body: str) -> ToolCall:
    """One ``<tool_call>`` body as a call (``error`` set when it is not a valid call)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg} at char "
                        f"{exc.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}")
    except RecursionError:  # a model can nest brackets past the decoder's recursion limit
        return ToolCall("", error="the tool call nests JSON too deeply; write "
                        "{\"name\": ..., \"arguments\": {...}}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='the tool call needs a "name" string: write '
                        '{"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f'the "arguments" of tool {obj["name"]!r} must be '
                        "a JSON object")
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen3 / Hermes calls: each ``<tool_call>`` JSON ``</tool_call>`` block; an opening tag
    without its closing one is a call with an error."""
    calls = [_hermes_call(m.group(1).strip()) for m in _HERMES_CALL.finditer(text)]
    rest = _HERMES_CALL.sub("", text)
    if "<tool_call>" in rest:
        calls.append(ToolCall("", error="a <tool_call> is not closed with </tool_call>"))
        rest = rest.split("<tool_call>", 1)[0]
    return ParsedTurn(rest.strip(), calls)


ToolParser = Callable[[str], ParsedTurn]
_PARSERS = Registry("tool-call parser", {"hermes": parse_hermes, "qwen3": parse_hermes})


def register_tool_parser(name: str, fn: ToolParser) -> None:
    """Make ``fn(text) -> ParsedTurn`` available as the tool-call parser ``name``."""
    _PARSERS.register(name, fn)


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (built-in: hermes, qwen3) or at the import path
    'pkg.module:function'; ValueError names an unknown one."""
    return _PARSERS.get(name)
