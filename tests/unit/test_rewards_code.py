"""code_reward on real HumanEval problems and on stdin/stdout and call-based tests."""

import json
import os

import pytest

from megatron_klear.data.prompts import code_tests
from megatron_klear.rewards import score_batch
from megatron_klear.rewards.code import code_reward, humaneval_cases

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _humaneval() -> list[dict]:
    with open(os.path.join(DATA, "humaneval_0_99.jsonl")) as f:
        return [json.loads(line) for line in f]


def _fence(code: str) -> str:
    return f"<think>let me write it</think>\nHere it is:\n```python\n{code}\n```\n"


def test_every_canonical_solution_scores_one():
    rows = _humaneval()
    assert len(rows) == 100
    scores = score_batch("code", [_fence(r["prompt"] + r["canonical_solution"]) for r in rows],
                         [code_tests(r) for r in rows])
    assert [r["task_id"] for r, s in zip(rows, scores) if s != 1.0] == []


def _reference_fraction(solution: str, row: dict) -> float:
    """Independent reference: run the original check's flat assert lines one by one in
    process (trusted, hand-written solutions only)."""
    lines = [ln.strip() for ln in row["test"].splitlines() if ln.startswith("    assert")]
    ns: dict = {}
    exec(row["test"], ns)
    exec(solution, ns)
    ns["candidate"] = ns[row["entry_point"]]
    passed = 0
    for line in lines:
        try:
            exec(line, ns)
            passed += 1
        except AssertionError:
            pass
    return passed / len(lines)


BUGGY = {  # one bug each; the problems have several asserts
    0: """def has_close_elements(numbers, threshold):
    for i in range(len(numbers) - 1):  # bug: only neighbours are compared
        if abs(numbers[i] - numbers[i + 1]) < threshold:
            return True
    return False
""",
    2: """def truncate_number(number: float) -> float:
    return round(number % 1.0, 1)  # bug: rounds the decimals
""",
    13: """def greatest_common_divisor(a: int, b: int) -> int:
    return min(a, b) if max(a, b) % min(a, b) == 0 else 1  # bug: not Euclid
""",
}


@pytest.mark.parametrize("idx", sorted(BUGGY))
def test_one_bug_scores_strictly_between(idx):
    row = _humaneval()[idx]
    expected = _reference_fraction(BUGGY[idx], row)
    assert 0.0 < expected < 1.0
    assert code_reward(_fence(BUGGY[idx]), code_tests(row)) == pytest.approx(expected)


def test_case_that_hangs_fails_alone():
    """The all-cases-in-one-sandbox fast path times out; the unfinished cases are rerun one
    sandbox each, so only the hanging case fails."""
    row = _humaneval()[2]
    solution = "def truncate_number(number):\n    while number == 1.33:\n        pass\n    return number % 1.0\n"
    assert _reference_fraction(solution.replace("pass", "break"), row) == 1.0
    assert code_reward(_fence(solution), code_tests(row), timeout_s=1.0) == pytest.approx(2 / 3)


@pytest.mark.parametrize("response", ["", "I cannot solve this.", _fence(""), _fence("def f(:\n  pass"),
                                      "```python\ndef broken(\n```", None,
                                      "<think>```python\nCODE\n```"])
def test_empty_or_syntax_error_scores_zero(response):
    row = _humaneval()[0]
    if response and "CODE" in response:  # an unclosed think: even a correct program is ignored
        response = response.replace("CODE", row["prompt"] + row["canonical_solution"])
    assert code_reward(response, code_tests(row)) == 0.0


def test_humaneval_cases_drop_asserts_that_ignore_candidate():
    test = "def check(candidate):\n    x = 2\n    assert candidate(x) == 4\n    assert True\n" \
           "    for i in range(3):\n        assert candidate(i) == 2 * i\n"
    cases = humaneval_cases(test)
    assert len(cases) == 2
    assert "x = 2" in cases[1] and "assert candidate(x) == 4" not in cases[1]


STDIO = {"inputs": ["1 2\n", "3 4\n", ["10", "20"], "7 8"], "outputs": ["3\n", "7", ["30"], "15  \n\n"]}


@pytest.mark.parametrize("code,expected", [
    ("a, b = map(int, open(0).read().split())\nprint(a + b)", 1.0),
    ("a, b = map(int, open(0).read().split())\nprint(' ', a + b, '  ')", 1.0),  # whitespace tolerant
    ("a, b = map(int, open(0).read().split())\nprint(a + b if a < 5 else 0)", 0.5),
    ("a, b = map(int, open(0).read().split())\nprint(a + b)\nraise SystemExit(3)", 0.0),
    ("print(3)", 0.25),
])
def test_stdin_stdout(code, expected):
    assert code_reward(_fence(code), STDIO) == pytest.approx(expected)


CALL = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6], [[3, 3], 6]],
        "outputs": [[0, 1], [1, 2], [[0, 1]]]}
TWO_SUM = """
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)  # a tuple compares like the JSON list
            seen[x] = i
"""


@pytest.mark.parametrize("code,expected", [
    (TWO_SUM, 1.0),
    ("def twoSum(nums, target):\n    return [0, 1]", 2 / 3),
    ("def twoSum(nums, target):\n    return None", 0.0),
    ("def twoSum(nums, target):\n    return True", 0.0),
])
def test_call_based(code, expected):
    assert code_reward(_fence(code), CALL) == pytest.approx(expected)


def test_call_based_single_argument_not_in_a_list():
    tests = {"fn_name": "double", "inputs": ["ab", 3], "outputs": ["abab", 6]}
    assert code_reward(_fence("def double(x):\n    return x * 2"), tests) == 1.0
    assert code_reward(_fence("def double(x):\n    return x + x if x == 3 else x"), tests) == 0.5


def test_unknown_test_format_is_a_clear_error():
    with pytest.raises(ValueError, match="entry_point"):
        code_reward(_fence("print(1)"), {"cases": []})
