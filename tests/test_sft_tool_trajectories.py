"""SFT on multi-turn tool trajectories (issue 40): assistant turns with ``tool_calls`` (empty
content), role ``tool`` responses and a record-level ``tools`` list, through
tests/data/qwen3_like_tool_chat_template.jinja (Qwen3's template with its tool parts).

The reference ids and mask are hand-written (text, label) segments of what the template
renders for the whole conversation, tokenised on their own by the real tiny character-level
tokenizer (tests/test_chat_template_sft.py ``expected``), so they do not depend on the code
under test: the trained ids are the full rendering and the mask covers exactly the assistant
turns (their ``<tool_call>`` blocks included), never the ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megatron_klear.data.prompts import DataError
from megatron_klear.data.sft import check_sft_records, load_sft_dataset
from megatron_klear.models.tiny import build_tokenizer
from tests.test_chat_template_sft import A, expected

TEMPLATE = Path(__file__).parent / "data" / "qwen3_like_tool_chat_template.jinja"
SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}


def _call(code: str, as_text: bool = False) -> dict:
    args = {"code": code}
    return {"type": "function",
            "function": {"name": "python", "arguments": json.dumps(args) if as_text else args}}


# three assistant turns: a call with no content (OpenAI's null), content then two calls
# (arguments as JSON text), then the answer; the two tool responses form one user turn
RECORD = {"tools": [SCHEMA], "messages": [
    {"role": "user", "content": "What is 37*89?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("print(37*89)")]},
    {"role": "tool", "content": "3293"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [_call("print(3293/89)", True), _call("print(3293/37)", True)]},
    {"role": "tool", "content": "37.0"},
    {"role": "tool", "content": "89.0"},
    {"role": "assistant", "content": "\\boxed{3293}"},
]}
SYS_TOOLS = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    f"<tools>\n{json.dumps(SCHEMA)}\n</tools>\n\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def _tool_call(code: str) -> str:
    return f'<tool_call>\n{{"name": "python", "arguments": {json.dumps({"code": code})}}}\n</tool_call>'


SEGMENTS = [
    (SYS_TOOLS + "<|im_start|>user\nWhat is 37*89?<|im_end|>\n" + A, 0),
    (_tool_call("print(37*89)") + "<|im_end|>\n", 1),
    ("<|im_start|>user\n<tool_response>\n3293\n</tool_response><|im_end|>\n" + A, 0),
    ("Let me check.\n" + _tool_call("print(3293/89)") + "\n" + _tool_call("print(3293/37)")
     + "<|im_end|>\n", 1),
    ("<|im_start|>user\n<tool_response>\n37.0\n</tool_response>\n<tool_response>\n89.0\n"
     "</tool_response><|im_end|>\n" + A, 0),
    ("<think>\n\n</think>\n\n\\boxed{3293}<|im_end|>\n", 1),  # the last turn: Qwen3's think
]


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tool_trajectory_trains_the_assistant_turns_as_rendered(tok, tmp_path):
    """Ids: the template's rendering of the whole conversation, tools block included; mask:
    the three assistant turns with their <tool_call> blocks, not the tool responses."""
    ids, mask = expected(tok, SEGMENTS)
    full = tok.apply_chat_template(RECORD["messages"], tools=RECORD["tools"], tokenize=False)
    assert tok(full, add_special_tokens=False)["input_ids"] == ids  # the fixture renders so
    [sample], _ = load_sft_dataset(_write(tmp_path, [RECORD]), tok, max_length=2048)
    assert (sample.input_ids, sample.loss_mask) == (ids, mask)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained.count("<tool_call>") == 3 and "<tool_response>" not in trained
    assert "3293\n</tool_response>" in tok.decode(ids)  # the responses are in the sequence


@pytest.mark.parametrize("bad,match", [
    ({"arguments": "print(37*89)"}, r"each tool call needs a 'name' and 'arguments'"),
    ({"name": ""}, r"each tool call needs a 'name' and 'arguments'"),
    ("tools", r"field 'tools' must be a list of tool JSON schemas"),
    ("no content", r"'assistant' messages need a 'content' string \(or 'tool_calls'\)"),
])
def test_malformed_tool_records_fail_naming_file_and_line(tok, tmp_path, bad, match):
    """After a good record, a bad one fails at its FILE:LINE, in the pre-flight check (no
    tokenizer) and when loading."""
    rec = json.loads(json.dumps(RECORD))
    if bad == "tools":
        rec["tools"] = ["python"]
    elif bad == "no content":
        del rec["messages"][1]["tool_calls"]
    else:
        rec["messages"][1]["tool_calls"][0]["function"].update(bad)
    path = _write(tmp_path, [RECORD, rec])
    with pytest.raises(DataError, match=rf"^{path}:2: .*{match}"):
        check_sft_records(path, 10)
    with pytest.raises(DataError, match=rf"^{path}:2: .*{match}"):
        load_sft_dataset(path, tok, max_length=2048)


def test_a_template_without_tool_calls_is_refused(tmp_path):
    """Plain ChatML drops the calls: nothing of them would be trained, so the record fails."""
    path = _write(tmp_path, [RECORD])
    with pytest.raises(DataError, match=rf"^{path}:1: the tool calls \['python'\] of assistant "
                                        r"message 1 are not rendered .* must render 'tool_calls'"):
        load_sft_dataset(path, build_tokenizer(), max_length=2048)


def test_end_of_turn_inside_a_call_is_ambiguous(tok, tmp_path):
    """A call whose code holds the template's end of turn could end the turn early: refused."""
    rec = json.loads(json.dumps(RECORD))
    rec["messages"][1]["tool_calls"] = [_call("print('<|im_end|>')")]
    path = _write(tmp_path, [rec])
    with pytest.raises(DataError, match=rf"^{path}:1: ambiguous loss mask: .*end of turn"):
        load_sft_dataset(path, tok, max_length=2048)


def test_the_tool_quickstart_data_trains_the_calls_and_answers(tmp_path):
    """The --tools quickstart's SFT data through the tiny tokenizer's tool template: every
    record loads; the mask is the model's calls and answers only (each a whole assistant
    turn as rendered), the python tool's outputs and the tools block are not trained; the
    demonstrations' styles come in about their shares; eval pairs are not in SFT or RL."""
    from megatron_klear.data.prompts import load_records
    from megatron_klear.data.synthetic import TOOL_USES, write_tool_arithmetic_data
    from megatron_klear.models.tiny import TOOL_CHAT_TEMPLATE
    from megatron_klear.rewards import score_batch

    paths = write_tool_arithmetic_data(tmp_path, seed=1, n_sft=400, n_rl=50, n_eval=20)
    tok = build_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    samples, stats = load_sft_dataset(paths["sft"], tok, max_length=256)
    assert stats.loaded == 400 and stats.truncated == stats.dropped == 0
    records = [rec for _, rec in load_records(paths["sft"])]
    for s, rec in zip(samples, records):
        trained = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
        msgs = rec["messages"]
        want = "".join((f'<tool_call>{{"name": "python", "arguments": '
                        f'{json.dumps(m["tool_calls"][0]["function"]["arguments"])}}}</tool_call>'
                        if m.get("tool_calls") else m["content"]) + "<|im_end|>\n"
                       for m in msgs if m["role"] == "assistant")
        assert trained == want
        assert "<tools>python: code</tools>" in tok.decode(s.input_ids)
    # which demonstrations end right: the "tool" share, by the real math reward
    answers = [r["messages"][-1]["content"] for r in records]
    labels = [str(math.prod(map(int, re.findall(r"\d+", r["messages"][0]["content"]))))
              for r in records]
    right = sum(score_batch("math", answers, labels)) / len(records)
    calls = sum(len(r["messages"]) > 2 for r in records) / len(records)
    shares = dict(TOOL_USES)
    assert abs(right - shares["tool"]) < 0.08 and abs(calls - 1 + shares["guess"]) < 0.08
    pairs = {name: {r["prompt"] for _, r in load_records(paths[name])} for name in ("rl", "eval")}
    sft_q = {r["messages"][0]["content"] for r in records}
    assert len(pairs["eval"]) == 20 and not pairs["eval"] & (pairs["rl"] | sft_q)
