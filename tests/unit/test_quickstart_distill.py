"""``quickstart --distill`` (issue 54): the half-gap measure against hand-computed values, its
table, and the refusal of an ``--out`` that holds a run of other settings."""

import json
import sys

import pytest

from megatron_klear import quickstart
from megatron_klear.quickstart import distill_table, half_gap

# student 0.5, teacher 0.875: the midpoint is 0.6875 (all exact in binary)
CURVE = [{"step": 0, "seconds": 0.0, "accuracy": 0.5},
         {"step": 10, "seconds": 31.0, "accuracy": 0.625},
         {"step": 20, "seconds": 62.5, "accuracy": 0.6875},
         {"step": 30, "seconds": 90.0, "accuracy": 0.75}]


def test_half_gap_is_the_first_step_at_the_midpoint():
    assert half_gap(0.5, 0.875, CURVE) == CURVE[2]           # 0.6875 reached exactly: counts
    assert half_gap(0.5, 0.875, CURVE[:2]) is None           # 0.625 < 0.6875: not reached
    assert half_gap(0.5, 0.6, CURVE) == CURVE[1]             # midpoint 0.55: the first above
    # a dip after the crossing does not move it
    dip = CURVE[:3] + [{"step": 30, "seconds": 90.0, "accuracy": 0.6}]
    assert half_gap(0.5, 0.875, dip)["step"] == 20


def test_distill_table_rows():
    arm = {"flags": [], "accuracy": 0.75, "vs_gppo": 0.0, "vs_gppo_se": 0.0,
           "gain_over_sft": 0.25, "gain_over_sft_se": 0.02, "rl_seconds": 100.0,
           "curve": CURVE, "half_gap": CURVE[2]}
    table = distill_table({"half_gap_target": 0.6875, "student_after_sft": 0.5,
                           "teacher": 0.875, "arms": {
                               "gppo": arm,
                               "opd": {**arm, "flags": ["--use-opd"], "half_gap": None}}})
    lines = table.splitlines()
    assert lines[0].startswith("half the gap: avg@k >= 0.688")
    assert "| gppo | `(GPPO)` | 0.750 | +0.000 +- 0.000 | +0.250 +- 0.020 | 100 | 20 (62 s) |" \
        in lines[3]
    assert "| opd | `--use-opd` |" in lines[4] and "| not reached |" in lines[4]


def test_out_with_other_settings_is_refused(tmp_path, monkeypatch, capsys):
    """A resumed --distill keeps its settings: another --rl-iters in the same --out exits 2
    with one line naming the file, before any stage runs."""
    (tmp_path / "distill_settings.json").write_text(json.dumps({"seed": 1}))
    monkeypatch.setattr(sys, "argv", ["quickstart", "--distill", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "distill_settings.json" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distill_settings.json"]
