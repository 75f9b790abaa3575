"""SFT records through a chat template that rewrites history (issue 28), and template args.

The tokenizer and template are Qwen3's own (tests/qwen3_files.py, fetched by
tools/setup_qwen3_tokenizer.sh; the tests skip, naming it, without them): the template drops
the reasoning of turns before the last user message, splits at </think> and writes an empty
think block in the generation prompt when enable_thinking is false. Expected ids and masks are written by hand as
(text, label) segments, each tokenised on its own; their concatenation must also be the
tokenisation of the whole text (no token crosses a segment boundary), so the reference does
not depend on the code under test.
"""

from __future__ import annotations

import json

import pytest

from megatron_klear.config import ConfigError, parse_config
from megatron_klear.data.prompts import DataError, parse_chat_template_kwargs, render_prompt, \
    set_chat_template_kwargs
from megatron_klear.data.sft import load_sft_dataset, tokenize_conversation
from megatron_klear.models.tiny import CHAT_TEMPLATE, build_tokenizer
from tests.qwen3_files import qwen3_chat_template, qwen3_tokenizer

NO_THINK = {"enable_thinking": False}
SYS = "<|im_start|>system\nYou are a careful solver.<|im_end|>\n"
U1 = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
U2 = "<|im_start|>user\nAnd 3*3?<|im_end|>\n"
A = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
# the record of the issue
ISSUE_RECORD = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\n2+2=4\n</think>\n\n\\boxed{4}"},
    {"role": "user", "content": "And 3*3?"},
    {"role": "assistant", "content": "<think>\n3*3=9\n</think>\n\n\\boxed{9}"},
]
# the first turn's reasoning is not in the rendering; the second turn keeps its own
ISSUE_SEGMENTS = [(SYS + U1 + A, 0), ("\\boxed{4}<|im_end|>\n", 1), (U2 + A, 0),
                  ("<think>\n3*3=9\n</think>\n\n\\boxed{9}<|im_end|>\n", 1)]


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def expected(tok, segments):
    """ids and mask of hand-written (text, label) segments; checks that tokenising the whole
    text gives the same ids (so the reference is the tokenisation of the whole text)."""
    ids, mask = [], []
    for text, label in segments:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [label] * len(seg)
    whole = "".join(text for text, _ in segments)
    assert tok(whole, add_special_tokens=False)["input_ids"] == ids
    return ids, mask


def test_qwen3_renders_as_the_tests_expect(tok):
    """Qwen3's behaviours the tests rely on, checked on its text."""
    full = tok.apply_chat_template(ISSUE_RECORD, tokenize=False)
    assert full == "".join(text for text, _ in ISSUE_SEGMENTS)
    assert "2+2=4" not in full  # reasoning of the earlier turn dropped
    prompt = tok.apply_chat_template(ISSUE_RECORD[:4], tokenize=False, add_generation_prompt=True,
                                     **NO_THINK)
    assert prompt.endswith(U2 + A + EMPTY_THINK)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, NO_THINK])
def test_issue_record(tok, kwargs):
    """Ids are the whole rendering; the mask is the two answers as rendered, whatever the
    thinking mode (the record's own reasoning is data, not a generation prompt)."""
    assert tokenize_conversation(tok, ISSUE_RECORD, kwargs) == expected(tok, ISSUE_SEGMENTS)


def _conversation(system: bool, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a careful solver."}] if system else []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Q{t}?"},
                 {"role": "assistant", "content": f"<think>\nr{t}\n</think>\n\nA{t}"}]
    return msgs


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_three_turns_with_and_without_system(tok, system, thinking):
    segments = [(SYS, 0)] if system else []
    for t in range(3):
        segments.append((f"<|im_start|>user\nQ{t}?<|im_end|>\n" + A, 0))
        reasoning = f"<think>\nr{t}\n</think>\n\n" if t == 2 else ""  # kept by the last turn
        segments.append((reasoning + f"A{t}<|im_end|>\n", 1))
    segments = _merge(segments)
    kwargs = {} if thinking else NO_THINK
    assert tokenize_conversation(tok, _conversation(system, 3), kwargs) == expected(tok, segments)


def _merge(segments):
    out = []
    for text, label in segments:
        if out and out[-1][1] == label:
            out[-1] = (out[-1][0] + text, label)
        else:
            out.append((text, label))
    return out


def test_answer_without_reasoning_and_the_empty_think_block(tok):
    """The last turn is rendered with an empty think block. In thinking mode the model
    produces it (trained); with enable_thinking false it is the generation prompt (not)."""
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    thinking = [(U1 + A, 0), (EMPTY_THINK + "4<|im_end|>\n", 1)]
    assert tokenize_conversation(tok, msgs, {}) == expected(tok, thinking)
    no_think = [(U1 + A + EMPTY_THINK, 0), ("4<|im_end|>\n", 1)]
    assert tokenize_conversation(tok, msgs, NO_THINK) == expected(tok, no_think)
    set_chat_template_kwargs(tok, NO_THINK)  # the tokenizer's --chat-template-kwargs
    try:
        assert tokenize_conversation(tok, msgs) == expected(tok, no_think)
    finally:
        set_chat_template_kwargs(tok, None)


def test_plain_chatml_is_unchanged(tok):
    """A template that does not rewrite history: every assistant turn (content and
    <|im_end|>\\n) is trained, nothing else, as before."""
    plain = build_tokenizer()
    msgs = _conversation(False, 2)
    segments = [("<|im_start|>user\nQ0?<|im_end|>\n" + A, 0),
                ("<think>\nr0\n</think>\n\nA0<|im_end|>\n", 1),
                ("<|im_start|>user\nQ1?<|im_end|>\n" + A, 0),
                ("<think>\nr1\n</think>\n\nA1<|im_end|>\n", 1)]
    assert tokenize_conversation(plain, msgs, {}) == expected(plain, segments)


ECHO_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if messages[-1].role == 'assistant' %}[last answer: "
                 "{{ messages[-1].content }}]{% endif %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("case,msgs,template", [
    # two assistant messages in a row: the first one is rendered with an empty think block
    # when it is the last message, without one when the second follows
    ("consecutive", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
                     {"role": "assistant", "content": "B"}], None),
    # a template that repeats the last answer: which copy is the turn?
    ("repeated", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}],
     ECHO_TEMPLATE),
    # plain ChatML keeps a leading newline: '\n\n' is one token across the turn's start
    ("straddle", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nA"}],
     CHAT_TEMPLATE),
])
def test_ambiguous_records_fail_naming_the_record(tok, tmp_path, case, msgs, template):
    """The error names the file and line of the record (after a good record where the
    template has good records: the repeating template repeats every last answer)."""
    path = tmp_path / "sft.jsonl"
    records = ([] if template == ECHO_TEMPLATE else [{"messages": ISSUE_RECORD}]) + \
        [{"messages": msgs}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    t = build_tokenizer()
    t.chat_template = template or qwen3_chat_template()
    with pytest.raises(DataError, match=rf"^{path}:{len(records)}: ambiguous loss mask: "):
        load_sft_dataset(path, t, max_length=512)


def test_parquet_records_with_chat_list_prompts_and_dotted_keys(tok, tmp_path):
    """A verl-style row: a chat-list prompt and the response nested under extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "What is 2+2?"}],
             "extra_info": {"response": "<think>\n2+2=4\n</think>\n\n\\boxed{4}", "index": 0}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")
    samples, _ = load_sft_dataset(tmp_path / "sft.parquet", tok, max_length=512,
                                  response_key="extra_info.response")
    want = expected(tok, [(U1 + A, 0), ("<think>\n2+2=4\n</think>\n\n\\boxed{4}<|im_end|>\n", 1)])
    assert (samples[0].input_ids, samples[0].loss_mask) == want


# ---------------------------------------------------------------- --chat-template-kwargs
def test_prompts_take_the_template_kwargs(tok):
    msgs = ISSUE_RECORD[:2]
    set_chat_template_kwargs(tok, parse_chat_template_kwargs('{"enable_thinking": false}'))
    try:
        assert render_prompt(tok, msgs) == SYS + U1 + A + EMPTY_THINK
    finally:
        set_chat_template_kwargs(tok, None)
    assert render_prompt(tok, msgs) == SYS + U1 + A


@pytest.mark.parametrize("value,match", [
    ("{enable_thinking: false}", "invalid JSON"),
    ('["enable_thinking"]', "expected a JSON object"),
])
def test_bad_template_kwargs_name_the_flag(value, match):
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.train.sft import SFTConfig

    with pytest.raises(ConfigError, match=f"--chat-template-kwargs .*{match}"):
        parse_chat_template_kwargs(value)
    base = ["--hf-checkpoint", "x", "--chat-template-kwargs", value]
    with pytest.raises(ConfigError, match="--chat-template-kwargs"):
        parse_config(SFTConfig, [*base, "--data-path", "d.jsonl"])
    with pytest.raises(ConfigError, match="--chat-template-kwargs"):
        parse_config(RLConfig, [*base, "--prompt-data", "p.jsonl"])


def test_klear_eval_rejects_bad_template_kwargs(tmp_path):
    from megatron_klear.eval.__main__ import build_parser, run
    from megatron_klear.train.rl import RLConfig

    args = build_parser().parse_args(["--model", str(tmp_path), "--benchmark", "b.jsonl",
                                      "--chat-template-kwargs", "{oops", "--out-dir",
                                      str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="--chat-template-kwargs '{oops': invalid JSON"):
        run(args)
    cfg = parse_config(RLConfig, ["--hf-checkpoint", "x", "--prompt-data", "p.jsonl",
                                  "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert parse_chat_template_kwargs(cfg.chat_template_kwargs) == NO_THINK
