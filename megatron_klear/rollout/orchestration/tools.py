"""Tools a model calls during a multi-turn rollout, and running one call safely.

A :class:`Tool` is a name, the JSON schema that goes into the prompt's ``tools`` (through
the chat template: Qwen3 lists them in its system block) and a function of the call's
arguments. Built-in: :func:`python_tool`, which runs the model's code in the rewards'
sandbox (rewards/sandbox.py: own namespaces, rlimits, wall and CPU limits, output cap, no
network). User tools are named by import path (``pkg.mod:fn``, see :func:`load_tool`): a
function of the arguments whose ``schema`` attribute is the OpenAI-style function schema
(the :func:`tool` decorator sets it).

:func:`run_tool_call` never raises for what a tool or the model does: an unreadable call, an
unknown tool, a tool that raises or runs past its wall time, or output past the cap gives the
model an error message or a truncated output.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

from megatron_klear.import_path import load_callable
from megatron_klear.rewards.sandbox import PYTHON_SCHEMA, SandboxJob, SandboxLimits, \
    run_python
from megatron_klear.rollout.orchestration.tool_calls import ToolCall

__all__ = ["Tool", "ToolResult", "tool", "load_tool", "python_tool", "run_tool_call",
           "PYTHON_SCHEMA"]


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``fn(arguments) -> output`` (any value; str() of it is shown)."""

    name: str
    schema: dict[str, Any]           # {"type": "function", "function": {"name", ...}}
    fn: Callable[[dict[str, Any]], Any]
    grace_s: float = 0.0             # wall time allowed past the limit (sandbox start-up)


@dataclass(frozen=True)
class ToolResult:
    """What the model is shown for one call; ``error``: the call failed (counted)."""

    text: str
    error: bool = False


def tool(schema: dict[str, Any]) -> Callable:
    """Decorator giving a user tool function its JSON ``schema`` (the function form
    ``{"type": "function", "function": {"name": ..., "description": ..., "parameters":
    {...}}}``), so that ``--tools pkg.mod:fn`` can load it."""
    def attach(fn: Callable) -> Callable:
        fn.schema = schema
        return fn
    return attach


def _schema_name(schema: Any, where: str) -> str:
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
        raise ValueError(f"{where}: its schema must look like {{\"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"parameters\": {...}}} (use the "
                         "megatron_klear.rollout.orchestration.tools.tool decorator)")
    return fn["name"]


def load_tool(path: str) -> Tool:
    """The user tool at the import path 'pkg.module:function' (a function of the arguments
    dict with a ``schema`` attribute); ValueError names what is missing."""
    fn = load_callable(path, "tool")
    schema = getattr(fn, "schema", None)
    return Tool(_schema_name(schema, f"tool {path!r}"), schema, fn)


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """The ``python`` tool: runs ``arguments["code"]`` in a fresh sandbox (rewards/sandbox.py)
    under ``limits`` and returns what it printed, with a note when it failed, timed out or
    printed past the output cap."""
    lim = limits or SandboxLimits(wall_s=5.0, output_bytes=64 << 10)

    def run(arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError('the python tool needs {"code": "<program>"}')
        res = run_python(SandboxJob({"main.py": code}, "main.py", limits=lim))
        out = (res.stdout + res.stderr).decode(errors="replace")
        if res.timed_out:
            out += f"\n[timed out after {lim.wall_s:g} s]"
        elif res.output_exceeded:
            out += f"\n[output cut at {lim.output_bytes} bytes]"
        elif res.returncode:
            out += f"\n[exit code {res.returncode}]"
        return out

    return Tool("python", PYTHON_SCHEMA, run, grace_s=10.0)


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"


def run_tool_call(call: ToolCall, tools: dict[str, Tool], wall_s: float,
                  max_chars: int) -> ToolResult:
    """Run one call of the model and return what it is shown: the tool's output (cut at
    ``max_chars``), or an error message for an unreadable call, an unknown tool, a tool that
    raised, or one still running after ``wall_s`` (+ its grace; the thread is left behind,
    a daemon, and its late answer dropped)."""
    if call.error is not None:
        return ToolResult(f"error: {call.error}", True)
    if call.name not in tools:
        return ToolResult(f"error: unknown tool {call.name!r}; the tools are "
                          f"{', '.join(sorted(tools)) or 'none'}", True)
    t = tools[call.name]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = t.fn(call.arguments)
        except Exception as exc:  # noqa: BLE001 - any failure of a tool is the model's to see
            box["exc"] = exc

    thread = threading.Thread(target=target, name=f"tool-{t.name}", daemon=True)
    thread.start()
    thread.join(wall_s + t.grace_s)
    if thread.is_alive():
        return ToolResult(f"error: tool {t.name!r} timed out after {wall_s:g} s", True)
    if "exc" in box:
        exc = box["exc"]
        return ToolResult(_truncate(f"error: tool {t.name!r} failed: {type(exc).__name__}: "
                                    f"{exc}", max_chars), True)
    out = box.get("out")
    text = out if isinstance(out, str) else json.dumps(out, default=str)
    return ToolResult(_truncate(text, max_chars))
