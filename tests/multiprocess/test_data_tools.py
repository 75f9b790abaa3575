"""Decontamination and test-case filtering: library functions and the tools/ CLIs."""

import json
import os
import subprocess
import sys

import pytest

from megatron_klear.data.decontaminate import decontaminate, ngrams
from megatron_klear.data.testcase_filter import fence_python, judge_problems
from megatron_klear.rewards.metrics import pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data")


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _tool(name, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=240)


def test_ngrams_by_hand():
    assert ngrams("The cat, the HAT!", 2) == {("the", "cat"), ("cat", "the"), ("the", "hat")}
    assert ngrams("one two", 3) == {("one", "two")}  # shorter than n: the whole text
    assert ngrams("", 3) == set()


def test_decontaminate_library():
    train = ["a b c d e f g h i j", "k l m n", "x y z"]
    kept, removed = decontaminate(train, {"ev": ["zz c d e f g h i j yy", "k l m n"]}, n=7)
    assert kept == [2]
    assert [(r.index, r.eval_set, r.eval_index, r.ngram) for r in removed] == \
        [(0, "ev", 0, "c d e f g h i"), (1, "ev", 1, "k l m n")]


def _eval_set(tmp_path):
    train = _rows(os.path.join(DATA, "gsm8k_test_20.jsonl"))
    q4, q7, q9 = (train[i]["question"].split() for i in (3, 6, 8))
    rows = [{"problem": " ".join(q4).upper().replace(".", " . ")},  # same words: line 4
            {"problem": "Consider this: " + " ".join(q7[2:11]) + " and more"},  # 9 words: line 7
            {"problem": "Unrelated " + " ".join(q9[0:8]) + " words"}]  # only 8 words: kept
    return _write(tmp_path / "eval.jsonl", rows)


def test_decontaminate_cli(tmp_path):
    out = tmp_path / "out" / "clean.jsonl"
    res = _tool("decontaminate.py", "--train", os.path.join(DATA, "gsm8k_test_20.jsonl"),
                "--eval", _eval_set(tmp_path), "--output", out, "--text-key", "question", "problem")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "out" / "clean.jsonl.report.json").read_text())
    assert [r["train_line"] for r in report["removed_items"]] == [4, 7]
    assert report["kept"] == 18 and report["total"] == 20
    kept = _rows(out)
    train = _rows(os.path.join(DATA, "gsm8k_test_20.jsonl"))
    assert kept == [r for i, r in enumerate(train) if i not in (3, 6)]
    assert sorted(os.listdir(tmp_path / "out")) == ["clean.jsonl", "clean.jsonl.report.json"]


def test_decontaminate_cli_bad_field_writes_nothing(tmp_path):
    out = tmp_path / "clean.jsonl"
    res = _tool("decontaminate.py", "--train", os.path.join(DATA, "gsm8k_test_20.jsonl"),
                "--eval", _eval_set(tmp_path), "--output", out, "--text-key", "nope")
    assert res.returncode == 2
    assert "eval.jsonl:1: none of the fields ['nope'] is present (set --text-key" in res.stderr
    assert not out.exists()


def test_judge_problems_keeps_problems_with_a_passing_response():
    tests = {"inputs": ["1 2", "3 4"], "outputs": ["3", "7"]}
    right = fence_python("a, b = map(int, input().split())\nprint(a + b)")
    wrong = fence_python("print(3)")
    verdicts = judge_problems([[wrong, right, wrong], [wrong, wrong]], [tests, tests], k=2)
    assert [(v.correct, v.kept) for v in verdicts] == [(1, True), (0, False)]
    assert verdicts[0].pass_at_k == pytest.approx(pass_at_k(3, 1, 2))


def test_filter_testcases_cli_drops_flawed_tests(tmp_path):
    rows = _rows(os.path.join(DATA, "humaneval_slice.jsonl"))
    assert rows[3]["entry_point"] == "add"
    rows[3]["test"] = rows[3]["test"].replace("assert candidate(0, 1) == 1", "assert candidate(0, 1) == 2")
    assert "== 2" in rows[3]["test"]  # the flaw: no correct solution can pass
    src = _write(tmp_path / "he.jsonl", rows)
    out = tmp_path / "kept.jsonl"
    res = _tool("filter_testcases.py", "--input", src, "--output", out, "--solution-key",
                "canonical_solution", "--solution-prefix-key", "prompt", "--num-workers", "2")
    assert res.returncode == 0, res.stderr
    assert [r["task_id"] for r in _rows(out)] == [r["task_id"] for r in rows[:3]]
    report = json.loads((tmp_path / "kept.jsonl.report.json").read_text())
    assert report["removed_lines"] == [4]


def test_filter_testcases_cli_missing_solution_field(tmp_path):
    out = tmp_path / "kept.jsonl"
    res = _tool("filter_testcases.py", "--input", os.path.join(DATA, "humaneval_slice.jsonl"),
                "--output", out, "--solution-key", "solution")
    assert res.returncode == 2
    assert "humaneval_slice.jsonl:1: missing field 'solution' (set --solution-key" in res.stderr
    assert not out.exists()



@pytest.mark.parametrize("tool, required", [
    ("decontaminate.py", ["--train", "t", "--eval", "e", "--output", "o"]),
    ("filter_testcases.py", ["--input", "i", "--output", "o", "--solution-key", "s"]),
    ("plot_metrics.py", ["--metrics", "m", "--out", "o"]),
    ("convert_hf_to_megatron.py", ["--hf-dir", "h", "--out-dir", "o"]),
])
def test_tools_refuse_an_unknown_flag_in_one_line(tmp_path, tool, required):
    """A mistyped flag gets exit 2 and one line naming it (not argparse's usage block)."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *required,
                          "--bogus-flag"], capture_output=True, text=True, env=env,
                         timeout=240, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"error: unrecognized arguments: --bogus-flag (see {tool} --help)"]
    assert not (tmp_path / "o").exists()
