"""benchmarks/paper_study.py (issue 53): each arm's launch differs from its baseline's in the
analysed setting only; a row's paired difference and SEs recomputed from hand-written evals;
the toy code task and its soft against hard reward in the real sandbox."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_klear.data.synthetic import (CODE_TEST_INPUTS, code_function_problem,
                                           write_arithmetic_data, write_code_function_data)
from megatron_klear.rewards import score_batch

ROOT = Path(__file__).resolve().parents[2]


def _load_study():
    """benchmarks/ is no package: load the runner by path (registered, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location("paper_study", ROOT / "benchmarks" / "paper_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper_study"] = module
    spec.loader.exec_module(module)
    return module


study = _load_study()


def _without(cmd: list[str], flags: tuple[str, ...]) -> list[str]:
    """``cmd`` without the ``--flag [value]`` pairs of ``flags`` (their values as launched)."""
    out = list(cmd)
    for i, tok in enumerate(flags):
        if tok.startswith("--"):
            j = out.index(tok)
            has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
            del out[j:j + 1 + has_value]
    return out


ALL = [*study.ANALYSES.values(), *study.SHARED_SFT.values()]
OUTPUT_FLAGS = ("--save", "--export-hf")


def _launch(out: Path, seed: int, analysis, arm) -> list[str]:
    """The arm's launch with its outputs (which must lie in its run dir) named OUT/..."""
    cmd, rdir = study.arm_command(out, seed, analysis, arm), study.run_dir(out, seed, analysis, arm)
    for flag in OUTPUT_FLAGS:
        value = Path(cmd[cmd.index(flag) + 1])
        assert value.parent == rdir, f"{arm.name}: {flag} {value} is not in {rdir}"
        cmd[cmd.index(flag) + 1] = f"OUT/{value.name}"
    return cmd


@pytest.mark.parametrize("analysis", ALL, ids=lambda a: a.name)
def test_each_arm_launch_differs_from_its_baseline_in_the_analysed_setting_only(analysis):
    out = Path("/study")
    for seed in (1, 2):
        base = _launch(out, seed, analysis, analysis.baseline)
        data = str(study.task_dir(out, seed, study.TASKS[analysis.task]) / "data")
        fmt = lambda flags: tuple(t.format(data=data) for t in flags)  # noqa: E731
        for arm in analysis.arms[1:]:
            assert study.run_dir(out, seed, analysis, arm) != \
                study.run_dir(out, seed, analysis, analysis.baseline)
            cmd = _launch(out, seed, analysis, arm)
            assert cmd != base
            assert _without(cmd, fmt(arm.flags)) == _without(base, fmt(analysis.baseline.flags))


def test_baselines_shared_across_analyses_are_one_run():
    out = Path("/study")
    a = study.ANALYSES
    dirs = {study.run_dir(out, 1, a[n], a[n].baseline) for n in ("5.2.1", "5.2.2", "5.2.5")}
    assert len(dirs) == 1
    assert study.run_dir(out, 1, a["5.1.1"], a["5.1.1"].baseline) == \
        study.task_dir(out, 1, study.TASKS["arith"])          # the shared SFT stage itself
    rl = study.arm_command(out, 1, a["5.2.1"], a["5.2.1"].baseline)
    assert rl[rl.index("--hf-checkpoint") + 1] == str(out / "seed1" / "arith" / "sft_hf")


def _write_samples(path: Path, scores: list[list[float]], bench: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"benchmark": bench, "problem": p, "score": s})
                            + "\n" for p, ss in enumerate(scores) for s in ss))


def test_a_rows_paired_se_recomputed_from_saved_evals(tmp_path):
    """5.2.5 at two seeds, 3 problems, k=2. Per-problem differences (off - on): seed 1
    [0.5, -0.5, 0.5] (mean 1/6), seed 2 [1, 0.5, 0] (mean 1/2): the difference is 1/3;
    pooled SE sqrt((4/3)/5)/sqrt(6) = sqrt(2/45); over seeds (1/3)/sqrt(2)/sqrt(2) = 1/6."""
    analysis = study.ANALYSES["5.2.5"]
    on, off = analysis.arms
    evals = {(1, on): [[1, 0], [1, 1], [0, 0]], (1, off): [[1, 1], [1, 0], [1, 0]],
             (2, on): [[0, 0], [0, 1], [1, 1]], (2, off): [[1, 1], [1, 1], [1, 1]]}
    for (seed, arm), scores in evals.items():
        _write_samples(study.run_dir(tmp_path, seed, analysis, arm) / "eval" / "samples.jsonl",
                       scores, "arith")
    rows = {r["arm"]: r for r in study.analyse(tmp_path, analysis, [1, 2])}
    assert rows["on"]["avg"] == pytest.approx((0.5 + 0.5) / 2)
    assert rows["off"]["avg_per_seed"] == pytest.approx([2 / 3, 1.0])
    row = rows["off"]
    assert row["diff"] == pytest.approx(1 / 3)
    assert row["diff_per_seed"] == pytest.approx([1 / 6, 1 / 2])
    assert row["se_pooled"] == pytest.approx(math.sqrt(2 / 45))
    assert row["se_seeds"] == pytest.approx(1 / 6)
    assert row["se"] == pytest.approx(math.sqrt(2 / 45))
    assert row["problems"] == 6 and row["verdict"] == "inconclusive"   # 1.58 SE


def test_splits_restrict_the_pairs_and_verdicts_follow_the_papers_direction(tmp_path):
    analysis = study.ANALYSES["5.1.1"]
    mixed, correct = analysis.arms
    data = study.task_dir(tmp_path, 1, study.TASKS["arith"]) / "data"
    data.mkdir(parents=True)
    (data / "splits.json").write_text(json.dumps(["easy", "hard", "easy", "hard"]))
    _write_samples(study.run_dir(tmp_path, 1, analysis, mixed) / "eval" / "samples.jsonl",
                   [[0, 0], [1, 1], [0, 0], [1, 1]], "arith")
    _write_samples(study.run_dir(tmp_path, 1, analysis, correct) / "eval" / "samples.jsonl",
                   [[1, 1], [0, 0], [1, 0], [1, 0]], "arith")
    rows = {r["split"]: r for r in study.analyse(tmp_path, analysis, [1]) if "diff" in r}
    assert rows["easy"]["diff"] == pytest.approx(0.75) and rows["easy"]["problems"] == 2
    assert rows["hard"]["diff"] == pytest.approx(-0.75)
    assert study.verdict(0.75, 0.25, 1) == "agrees"
    assert study.verdict(0.75, 0.25, -1) == "disagrees"
    assert study.verdict(0.4, 0.25, 1) == "inconclusive"
    assert study.verdict(0.5, 0.0, 1) == "inconclusive"
    assert study.verdict(-0.6, 0.25, 0) == "differs"


def test_correct_only_sft_data_and_the_easy_hard_split(tmp_path):
    paths = write_arithmetic_data(tmp_path, seed=3)
    study._correct_only(paths["sft"], tmp_path / "correct.jsonl")
    mixed = paths["sft"].read_text().splitlines()
    kept = [json.loads(x) for x in (tmp_path / "correct.jsonl").read_text().splitlines()]
    assert 0.5 < len(kept) / len(mixed) < 0.7             # 40% of the boxes are wrong
    for r in kept:
        reasoning, boxed = r["response"].split("</think>")
        assert reasoning.rsplit("=", 1)[1].rstrip(".") in boxed
    assert study.arith_split("What is 300+2*4?") == "easy"
    assert study.arith_split("What is 300+2*5?") == "hard"
    with pytest.raises(ValueError, match="not a quickstart"):
        study.arith_split("What is 2*5?")


# -------------------------------------------------------------------------- the toy code task
def test_code_task_data(tmp_path):
    from megatron_klear.models.tiny import build_tokenizer

    paths = write_code_function_data(tmp_path, seed=2)
    rows = {n: [json.loads(x) for x in p.read_text().splitlines()] for n, p in paths.items()}
    assert len(rows["eval"]) == 48
    held_out = {r["prompt"] for r in rows["eval"]}
    assert not held_out & ({r["prompt"] for r in rows["sft"]} | {r["prompt"] for r in rows["rl"]})
    assert all(len(r["inputs"]) == len(r["outputs"]) == len(CODE_TEST_INPUTS)
               for r in rows["rl"] + rows["eval"])
    flawed = sum(code_function_problem(1, 0)["response"] != r["response"] and
                 "x*x" in r["response"] for r in rows["sft"])
    assert 0.1 < flawed / len(rows["sft"]) < 0.25        # 0.4 x 0.4 squares
    tok = build_tokenizer()
    for r in rows["sft"][:50]:    # the character-level tokenizer writes every program
        ids = tok(r["prompt"] + r["response"], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == r["prompt"] + r["response"]


def test_soft_and_hard_code_rewards_differ_on_partially_correct_programs():
    """Through the real sandbox: a correct program scores 1 both ways, one that passes no test
    0 both ways; the flawed ones score their pass rate (soft) but 0 (hard)."""
    a, b = 17, 4
    tests = {k: v for k, v in code_function_problem(a, b).items() if k in ("inputs", "outputs")}
    responses = {flaw: code_function_problem(a, b, flaw)["response"]
                 for flaw in (None, "slope", "square", "offset")}
    responses["no program"] = "<think>f(x)=17*x+4</think> 4"
    names = list(responses)
    soft = dict(zip(names, score_batch("code", [responses[n] for n in names], [tests] * len(names))))
    hard = dict(zip(names, score_batch("code_hard", [responses[n] for n in names],
                                       [tests] * len(names))))
    assert soft == pytest.approx({None: 1.0, "slope": 1 / 3, "square": 2 / 3, "offset": 0.0,
                                  "no program": 0.0})
    assert hard == {None: 1.0, "slope": 0.0, "square": 0.0, "offset": 0.0, "no program": 0.0}
