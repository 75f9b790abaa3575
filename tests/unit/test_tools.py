"""Tool calls and tools of multi-turn rollouts (rollout/orchestration/tool_calls.py, rollout/orchestration/tools.py):
Qwen3 / Hermes calls parsed from the model's text, badly written calls turned into errors
for the model, user tools and parsers by import path, and hostile calls (a tool that raises
or hangs, a fork bomb, an infinite loop, a huge print in the Python tool) contained."""

import threading
import time

import psutil
import pytest

from megatron_klear.rewards.sandbox import SandboxLimits
from megatron_klear.rollout.orchestration.tool_calls import ParsedTurn, ToolCall, get_tool_parser, \
    parse_hermes
from megatron_klear.rollout.orchestration.tools import (Tool, load_tool, python_tool,
                                                        run_tool_call, tool)

HERE = "tests.unit.test_tools"


@tool({"type": "function", "function": {"name": "add", "description": "a + b",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "number"}, "b": {"type": "number"}}}}})
def add(arguments):
    """A user tool by import path."""
    return arguments["a"] + arguments["b"]


def always_calls_count(text):
    """A user parser by import path: every turn is one call of ``count``."""
    return ParsedTurn("", [ToolCall("count", {"text": text})])


def not_a_tool(arguments):
    return 0


def test_hermes_calls_in_order_with_their_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
            '\n</tool_call>')
    got = parse_hermes(text)
    assert got.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in got.calls] == [
        ("python", {"code": "print(1)"}, None), ("add", {"a": 1, "b": 2}, None)]
    assert parse_hermes("The answer is 4.").calls == []
    assert get_tool_parser("qwen3") is parse_hermes


@pytest.mark.parametrize("body, needle", [
    ('{"name": "python", "arguments": {"code": ', "not valid JSON"),
    ('["python"]', 'needs a "name"'),
    ('{"name": "python", "arguments": [1]}', "must be a JSON object"),
    ("[" * 5000, "nests JSON too deeply"),   # json.loads raised RecursionError: a crashed step
    ('{"name": "python", "arguments": "' + "[" * 5000 + '"}', "must be a JSON object"),
])
def test_badly_written_calls_become_errors(body, needle):
    (call,) = parse_hermes(f"<tool_call>\n{body}\n</tool_call>").calls
    assert call.error is not None and needle in call.error
    res = run_tool_call(call, {}, 1.0, 1000)
    assert res.error and needle in res.text


def test_unclosed_call_is_an_error():
    got = parse_hermes('hi <tool_call>{"name": "python"')
    assert got.content == "hi" and "not closed" in got.calls[0].error


def test_user_tool_and_parser_by_import_path():
    t = load_tool(f"{HERE}:add")
    assert t.name == "add" and t.schema["function"]["description"] == "a + b"
    assert run_tool_call(ToolCall("add", {"a": 2, "b": 3}), {"add": t}, 1.0, 100).text == "5"
    assert get_tool_parser(f"{HERE}:always_calls_count")("x").calls[0].name == "count"
    with pytest.raises(ValueError, match="schema"):
        load_tool(f"{HERE}:not_a_tool")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


def test_unknown_tool_raising_tool_hanging_tool_and_huge_output():
    def boom(a):
        raise KeyError("x")

    def hang(a):
        time.sleep(30)

    tools = {"boom": Tool("boom", {}, boom), "hang": Tool("hang", {}, hang),
             "big": Tool("big", {}, lambda a: "y" * 10_000)}
    res = run_tool_call(ToolCall("nope"), tools, 1.0, 100)
    assert res.error and "unknown tool 'nope'" in res.text and "big, boom, hang" in res.text
    res = run_tool_call(ToolCall("boom"), tools, 1.0, 100)
    assert res.error and "KeyError" in res.text
    t0 = time.monotonic()
    res = run_tool_call(ToolCall("hang"), tools, 0.3, 100)
    assert res.error and "timed out" in res.text and time.monotonic() - t0 < 5
    res = run_tool_call(ToolCall("big"), tools, 1.0, 100)
    assert not res.error and res.text.startswith("y" * 100) and "9900 more characters cut" \
        in res.text and len(res.text) < 200


def test_python_tool_runs_code_and_contains_hostile_programs():
    py = {"python": python_tool(SandboxLimits(wall_s=2.0, output_bytes=4096))}

    def run(code):
        return run_tool_call(ToolCall("python", {"code": code}), py, 2.0, 8192)

    assert run("print(6 * 7)").text == "42\n"
    assert "ZeroDivisionError" in run("1 / 0").text and "[exit code 1]" in run("1/0").text
    assert "[timed out after 2 s]" in run("while True:\n    pass\n").text
    huge = run("print('z' * 10_000_000)").text
    assert "[output cut at 4096 bytes]" in huge and len(huge) < 5000
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n")
    me, peak = psutil.Process(), [0]
    before = set(me.children(recursive=True))   # earlier tests' servers and workers
    watching = threading.Event()

    def watch():  # the bomb's processes, seen from here while it runs
        while not watching.is_set():
            peak[0] = max(peak[0], len(set(me.children(recursive=True)) - before))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert "[timed out" in run(bomb).text
    finally:
        watching.set()
        watcher.join()
    assert peak[0] > 2 and set(me.children(recursive=True)) <= before   # forked, none survive
    assert "no network" in run("import socket\ntry:\n    socket.create_connection(("
                                  "'1.1.1.1', 80), timeout=1)\nexcept OSError as e:\n"
                                  "    print('no network')\n").text
    assert run("print(1)").text == "1\n"       # and the next call still works
    assert run_tool_call(ToolCall("python", {}), py, 2.0, 100).error
