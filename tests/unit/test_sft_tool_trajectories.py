"""SFT on multi-turn tool trajectories (issues 40, 56): assistant turns with ``tool_calls``
(empty content), role ``tool`` responses and a record-level ``tools`` list, through Qwen3's
real tokenizer and chat template (tests/qwen3_files.py; the tests skip, naming the setup
script, without them).

The reference ids and mask are hand-written (text, label) segments of what the template
renders for the whole conversation, tokenised on their own (tests/unit/test_chat_template_sft.py
``expected``), so they do not depend on the code under test: the trained ids are the full
rendering and the mask covers exactly the assistant turns (their ``<tool_call>`` blocks
included), never the ``<tool_response>`` blocks. Agentic records whose earlier turns carry
reasoning (which Qwen3's template drops before the last user query) are checked under both
``--sft-multi-turn`` conventions against an independent span search in the rendered text.
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
from tests.qwen3_files import qwen3_tokenizer
from tests.unit.test_chat_template_sft import A, expected

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
    return qwen3_tokenizer()


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_tool_trajectory_trains_the_assistant_turns_as_rendered(tok, tmp_path):
    """Ids: the template's rendering of the whole conversation, tools block included; mask:
    the three assistant turns with their <tool_call> blocks, not the tool responses."""
    ids, mask = expected(tok, SEGMENTS)
    # Qwen3's template cannot render OpenAI's null content: the loader makes it ''
    msgs = [dict(m, content=m["content"] or "") for m in RECORD["messages"]]
    full = tok.apply_chat_template(msgs, tools=RECORD["tools"], tokenize=False)
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


# An agentic record in the shape Qwen3's template drops reasoning from: turns with reasoning
# (as reasoning_content and as <think> in the content) and tool calls, consecutive tool
# responses, a tools block, then a new user question. Rendered whole, every turn before the
# last question loses its reasoning; the loader refused such records before issue 56.
AGENTIC = {"tools": [SCHEMA], "messages": [
    {"role": "system", "content": "You are careful."},
    {"role": "user", "content": "What is 37*89?"},
    {"role": "assistant", "reasoning_content": "I should run it.", "content": "",
     "tool_calls": [_call("print(37*89)")]},
    {"role": "tool", "content": "3293"},
    {"role": "assistant", "content": "<think>\nCheck both factors.\n</think>\n\nLet me check.",
     "tool_calls": [_call("print(3293/89)", True), _call("print(3293/37)", True)]},
    {"role": "tool", "content": "37.0"},
    {"role": "tool", "content": "89.0"},
    {"role": "assistant", "content": "<think>\nIt is 3293.\n</think>\n\n\\boxed{3293}"},
    {"role": "user", "content": "And 12*12?"},
    {"role": "assistant", "reasoning_content": "Easy.", "content": "",
     "tool_calls": [_call("print(12*12)")]},
    {"role": "tool", "content": "144"},
    {"role": "assistant", "content": "\\boxed{144}"},
]}
REASONING = ("I should run it.", "Check both factors.", "It is 3293.", "Easy.")


def _span_mask(tok, text: str, last_only: bool) -> tuple[list[int], list[int]]:
    """The independent reference: ids of ``text`` and a mask over every span from just after
    ``<|im_start|>assistant\\n`` through the next ``<|im_end|>`` and the newline after it
    (only the last such span with ``last_only``), found by a regular expression in the
    rendered text."""
    spans = [m.span(1) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n?)", text,
                                            re.S)]
    spans = spans[-1:] if last_only else spans
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(any(s <= a and b <= e for s, e in spans))
                              for a, b in enc["offset_mapping"]]


def _trained(tok, sample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_whole_convention_trains_earlier_turns_as_rendered_without_their_reasoning(tok,
                                                                                    tmp_path):
    """The default: one sample, the whole conversation as Qwen3 renders it; the mask is the
    span search's (5 assistant turns); reasoning before the last question is neither in the
    ids nor trained, the last turns' reasoning is both; tools block and responses untrained."""
    [sample], stats = load_sft_dataset(_write(tmp_path, [AGENTIC]), tok, max_length=4096)
    full = tok.apply_chat_template(AGENTIC["messages"], tools=AGENTIC["tools"], tokenize=False)
    assert (sample.input_ids, sample.loss_mask) == _span_mask(tok, full, last_only=False)
    trained = _trained(tok, sample)
    assert trained.count("<|im_end|>") == 5 and trained.count("<tool_call>") == 4
    for dropped in REASONING[:3]:
        assert dropped not in full
    assert "<think>\nEasy.\n</think>" in trained and "<think>\n\n</think>" in trained
    assert "<tool_response>" not in trained and "<tools>" not in trained
    assert stats.loaded == 1


def test_per_turn_convention_trains_each_turn_as_generated_with_its_reasoning(tok, tmp_path):
    """--sft-multi-turn per-turn: one sample per assistant turn, the conversation up to it
    rendered as at generation time (its reasoning shown), only that turn trained."""
    samples, stats = load_sft_dataset(_write(tmp_path, [AGENTIC]), tok, max_length=4096,
                                      multi_turn="per-turn")
    msgs = AGENTIC["messages"]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert stats.loaded == len(samples) == len(turns) == 5
    for sample, i in zip(samples, turns):
        text = tok.apply_chat_template(msgs[:i + 1], tools=AGENTIC["tools"], tokenize=False)
        assert (sample.input_ids, sample.loss_mask) == _span_mask(tok, text, last_only=True)
        assert _trained(tok, sample).startswith("<think>\n")  # each turn with its reasoning
    for sample, reasoning in zip([samples[0], samples[1], samples[2], samples[3]], REASONING):
        assert f"<think>\n{reasoning}\n</think>" in _trained(tok, sample)


def test_still_ambiguous_agentic_records_fail_naming_file_line_and_turn(tok, tmp_path):
    """Two assistant messages in a row: Qwen3 renders the first one with an empty think block
    when it is last and without one when the second follows; no convention can tell where
    the second starts in the whole rendering: refused at FILE:LINE naming the turn."""
    bad = json.loads(json.dumps(AGENTIC))
    bad["messages"].insert(4, {"role": "assistant", "content": "Hmm."})
    path = _write(tmp_path, [AGENTIC, bad])
    with pytest.raises(DataError, match=rf"^{path}:2: ambiguous loss mask: the start of "
                                        r"assistant message 5 is not found"):
        load_sft_dataset(path, tok, max_length=4096)
