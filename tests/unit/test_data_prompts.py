"""Prompt datasets: JSONL/Parquet, configurable fields, labels, chat template, errors."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_klear.data.prompts import DataError, load_prompt_dataset, load_records, render_prompt
from megatron_klear.models.tiny import build_tokenizer

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_answers_and_meta():
    samples = load_prompt_dataset(os.path.join(DATA, "gsm8k_test_20.jsonl"), prompt_key="question",
                                  answer_format="gsm8k", system_prompt="Think step by step.")
    assert len(samples) == 20
    first = samples[0]
    assert first.label == "18"  # "... #### 18" in the data
    assert first.messages[0] == {"role": "system", "content": "Think step by step."}
    assert first.messages[1]["content"].startswith("Janet")
    assert first.meta["line"] == 1 and first.meta["idx"] == 0


def test_boxed_answers_from_worked_solutions():
    samples = load_prompt_dataset(os.path.join(DATA, "minerva_math_40.jsonl"), prompt_key="problem",
                                  answer_key="solution", answer_format="boxed")
    assert samples[0].label == "1.6"


def test_humaneval_labels_are_tests_dicts():
    samples = load_prompt_dataset(os.path.join(DATA, "humaneval_slice.jsonl"))
    label = samples[0].label
    assert set(label) == {"test", "entry_point", "context"}
    assert label["entry_point"] == "has_close_elements"


def test_stdio_and_apps_style_tests(tmp_path):
    rows = [{"prompt": "add", "inputs": ["1 2"], "outputs": ["3"]},
            {"prompt": "call", "input_output": json.dumps({"inputs": [[1]], "outputs": [2], "fn_name": "f"})}]
    path = _write_jsonl(tmp_path / "code.jsonl", rows)
    labels = [s.label for s in load_prompt_dataset(path)]
    assert labels == [{"inputs": ["1 2"], "outputs": ["3"]},
                      {"inputs": [[1]], "outputs": [2], "fn_name": "f"}]
    apps = load_prompt_dataset(path, answer_key="input_output")
    assert apps[1].label["fn_name"] == "f"


def test_parquet_equals_jsonl(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(DATA, "gsm8k_test_20.jsonl"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
    a = load_prompt_dataset(tmp_path / "g.parquet", prompt_key="question", answer_format="gsm8k")
    b = load_prompt_dataset(os.path.join(DATA, "gsm8k_test_20.jsonl"), prompt_key="question",
                            answer_format="gsm8k")
    assert [(s.messages, s.label) for s in a] == [(s.messages, s.label) for s in b]
    assert [line for line, _ in load_records(tmp_path / "g.parquet")][:3] == [1, 2, 3]


def test_messages_key_and_chat_template(tmp_path):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "1+1?"}]
    path = _write_jsonl(tmp_path / "m.jsonl", [{"conv": msgs, "answer": "2"}])
    sample = load_prompt_dataset(path, messages_key="conv")[0]
    assert sample.messages == msgs
    text = render_prompt(build_tokenizer(), sample.messages)
    assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n" \
                   "<|im_start|>assistant\n"


@pytest.mark.parametrize("rows,kwargs,message", [
    ([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}], {},
     r"x.jsonl:2: missing field 'prompt' \(set --prompt-key"),
    ([{"prompt": "a"}], {}, r"x.jsonl:1: missing field 'answer' \(set --answer-key"),
    ([{"prompt": "a", "answer": "no hashes"}], {"answer_format": "gsm8k"}, r"x.jsonl:1: answer has no '####'"),
    ([{"prompt": "a", "answer": "1"}], {"messages_key": "conv"}, r"x.jsonl:1: missing field 'conv' \(set --messages-key"),
    ([{"conv": [{"role": "user"}], "answer": "1"}], {"messages_key": "conv"}, r"x.jsonl:1: field 'conv' must be"),
    ([{"prompt": "a", "answer": "1"}], {"answer_format": "nope"}, r"unknown --answer-format"),
])
def test_clear_errors(tmp_path, rows, kwargs, message):
    path = _write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_prompt_dataset(path, **kwargs)


def test_bad_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{not json\n')
    with pytest.raises(DataError, match="bad.jsonl:2: invalid JSON"):
        load_prompt_dataset(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="use .jsonl or .parquet"):
        load_records(_write_jsonl(tmp_path / "x.json", []))
    with pytest.raises(DataError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
