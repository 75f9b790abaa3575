"""Published dataset formats read as they are (issue 28), from small records written by hand.

- verl/slime/Klear RL Parquet: chat-list ``prompt``, nested ``reward_model.ground_truth`` and
  ``extra_info.*`` (dotted ``--*-key`` flags);
- LiveCodeBench code_generation rows: JSON-string tests, private tests as
  base64(zlib(pickle(JSON string))), ``metadata`` JSON with ``func_name``; a hostile pickle is
  refused and runs nothing.
The code reward runs the real sandbox (one process per test case).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib

import pytest

from megatron_klear.rewards.livecodebench import BadTestCases, lcb_tests
from megatron_klear.data.prompts import DataError, load_prompt_dataset, render_prompt, \
    set_prompt_template
from megatron_klear.models.tiny import build_tokenizer
from megatron_klear.rewards.code import code_reward


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


VERL_ROWS = [
    {"data_source": "math_dapo", "ability": "math",
     "prompt": [{"role": "system", "content": "Think step by step."},
                {"role": "user", "content": "What is 2+2?"}],
     "reward_model": {"style": "rule", "ground_truth": "4"},
     "extra_info": {"index": 7, "split": "train", "answer": "four"}},
    {"data_source": "codecontests", "ability": "code",
     "prompt": [{"role": "user", "content": "Print the sum of two integers."}],
     "reward_model": {"style": "rule",
                      "ground_truth": json.dumps({"inputs": ["1 2\n", "5 7\n"],
                                                  "outputs": ["3\n", "12\n"]})},
     "extra_info": {"index": 8, "split": "train", "answer": "n/a"}},
]


def test_verl_parquet_chat_list_prompts_and_nested_answers(tmp_path):
    path = _parquet(tmp_path / "train.parquet", VERL_ROWS)
    math, code = load_prompt_dataset(path, answer_key="reward_model.ground_truth")
    assert math.messages == VERL_ROWS[0]["prompt"]
    assert math.label == "4" and math.meta["data_source"] == "math_dapo"
    assert code.messages == VERL_ROWS[1]["prompt"]
    assert code.label == {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    # any nested field, by its dotted key
    labels = [s.label for s in load_prompt_dataset(path, answer_key="extra_info.answer")]
    assert labels == ["four", "n/a"]
    # the chat list goes through the chat template ...
    tok = build_tokenizer()
    assert render_prompt(tok, math.messages) == (
        "<|im_start|>system\nThink step by step.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    # ... and --prompt-template raw renders its contents, system included, a blank line apart
    set_prompt_template(tok, "raw")
    assert render_prompt(tok, math.messages) == "Think step by step.\n\nWhat is 2+2?"
    # the code label scores with the real sandbox
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_reward(good, code.label) == 1.0


@pytest.mark.parametrize("rows,kwargs,match", [
    (VERL_ROWS, {"answer_key": "reward_model.truth"},
     r"train.parquet:1: missing field 'reward_model.truth' \(set --answer-key"),
    (VERL_ROWS, {"prompt_key": "extra_info.question", "answer_key": "extra_info.answer"},
     r"train.parquet:1: missing field 'extra_info.question' \(set --prompt-key"),
    ([{**VERL_ROWS[0], "prompt": [{"role": "user", "text": "hi"}]}],
     {"answer_key": "reward_model.ground_truth"},
     r"train.parquet:1: field 'prompt' must be a string or a non-empty chat list"),
])
def test_bad_nested_fields_name_the_row_and_flag(tmp_path, rows, kwargs, match):
    path = _parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=match):
        load_prompt_dataset(path, **kwargs)


# ------------------------------------------------------------------------- LiveCodeBench
def _lcb_private(cases) -> str:
    """How code_generation_lite stores private tests: base64(zlib(pickle(JSON string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def _lcb_row(qid, public, private, func_name=None, starter=""):
    return {"question_title": qid, "question_content": f"Solve {qid}.", "platform": "leetcode",
            "question_id": qid, "contest_id": "c1", "contest_date": "2024-08-01T00:00:00",
            "starter_code": starter, "difficulty": "easy",
            "public_test_cases": json.dumps(public), "private_test_cases": private,
            "metadata": json.dumps({"func_name": func_name} if func_name else {})}


STDIN_PUBLIC = [{"input": "3\n", "output": "6\n", "testtype": "stdin"}]
STDIN_PRIVATE = [{"input": "5\n", "output": "10\n", "testtype": "stdin"},
                 {"input": "0\n", "output": "0\n", "testtype": "stdin"}]
CALL_PUBLIC = [{"input": "[1, 2, 3]\n4", "output": "10", "testtype": "functional"}]
CALL_PRIVATE = [{"input": "[]\n0", "output": "0", "testtype": "functional"},
                {"input": "[5]\n-5", "output": "0", "testtype": "functional"}]
LCB_ROWS = [
    _lcb_row("double", STDIN_PUBLIC, _lcb_private(STDIN_PRIVATE)),
    # private tests may also be plain JSON (the older code_generation release)
    _lcb_row("addAll", CALL_PUBLIC, json.dumps(CALL_PRIVATE), func_name="addAll",
             starter="class Solution:\n    def addAll(self, nums: List[int], k: int) -> int:\n"),
]
STDIN_TESTS = {"inputs": ["3\n", "5\n", "0\n"], "outputs": ["6\n", "10\n", "0\n"]}
CALL_TESTS = {"inputs": [[[1, 2, 3], 4], [[], 0], [[5], -5]], "outputs": [10, 0, 0],
              "fn_name": "addAll"}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_livecodebench_rows_as_published(tmp_path, suffix):
    path = tmp_path / f"lcb.{suffix}"
    if suffix == "parquet":
        _parquet(path, LCB_ROWS)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in LCB_ROWS))
    stdin, call = load_prompt_dataset(path, prompt_key="question_content")
    assert stdin.messages == [{"role": "user", "content": "Solve double."}]
    assert stdin.label == STDIN_TESTS and call.label == CALL_TESTS


def test_code_reward_reads_livecodebench_rows(tmp_path):
    """The reward takes a row as it is; fractions follow the hand-counted cases."""
    stdin_row, call_row = LCB_ROWS
    double = "```python\nprint(2 * int(input()))\n```"
    assert code_reward(double, stdin_row) == 1.0
    assert code_reward("```python\nprint(6)\n```", stdin_row) == pytest.approx(1 / 3)
    add = ("```python\nclass Solution:\n    def addAll(self, nums, k):\n"
           "        return sum(nums) + k\n```")
    assert code_reward(add, call_row) == 1.0
    assert code_reward(add.replace("+ k", "+ abs(k)"), call_row) == pytest.approx(2 / 3)


class _Hostile:
    """A pickle whose load would run a shell command (``os.system``) if allowed."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload", ["reduce", "nested", "list"])
def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "pwned"
    obj = {"reduce": _Hostile(marker), "nested": [json.dumps(STDIN_PRIVATE), _Hostile(marker)],
           "list": STDIN_PRIVATE}[payload]
    blob = base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()
    if payload != "list":  # control: the plain unpickler does run the command
        pickle.loads(zlib.decompress(base64.b64decode(blob)))
        assert marker.exists()
        marker.unlink()
    row = _lcb_row("double", STDIN_PUBLIC, blob)
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    match = "refused: the pickle asks for the global" if payload != "list" else \
        "the pickle holds a list, not a JSON string"
    with pytest.raises(DataError, match=rf"lcb.jsonl:1: private_test_cases: .*{match}"):
        load_prompt_dataset(path, prompt_key="question_content")
    with pytest.raises(BadTestCases, match=match):
        lcb_tests(row)
    assert not marker.exists()
