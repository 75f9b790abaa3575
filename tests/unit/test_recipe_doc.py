"""Every row of docs/recipe.md's table that names a project flag holds in both Klear examples,
parsed by the trainer's own config parser (the dry runs are tests/examples/test_examples.py)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {4: "rl_math.yaml", 5: "rl_code.yaml"}   # table column -> example


def _rows() -> list[tuple[str, str, int, str]]:
    """(setting, flag, column, value) for every backticked flag and example value."""
    out = []
    for line in (ROOT / "docs" / "recipe.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6:
            continue
        flag = re.fullmatch(r"`(--[a-z0-9-]+)`", cells[3])
        for col in EXAMPLES:
            value = re.fullmatch(r"`([^`]+)`", cells[col])
            if flag and value:
                out.append((cells[0], flag.group(1), col, value.group(1)))
    return out


ROWS = _rows()


@pytest.fixture(scope="module")
def configs():
    from megatron_klear.config import parse_config
    from megatron_klear.train.rl import RLConfig

    return {col: parse_config(RLConfig, ["--config", str(ROOT / "examples" / "klear_8b" / name),
                                         "--hf-checkpoint", "unused", "--prompt-data", "unused"])
            for col, name in EXAMPLES.items()}


def test_the_table_covers_the_recipe():
    flags = {flag for _, flag, _, _ in ROWS}
    assert len(ROWS) >= 50 and {"--dual-clip", "--loss-aggregation", "--weight-decay",
                                "--rollout-gen-batch-size", "--truncate-prompt",
                                "--eval-temperature", "--reward"} <= flags


@pytest.mark.parametrize("setting,flag,col,value", ROWS,
                         ids=[f"{r[1]}-{EXAMPLES[r[2]]}" for r in ROWS])
def test_row_holds_in_the_example(configs, setting, flag, col, value):
    got = getattr(configs[col], flag[2:].replace("-", "_"))
    if isinstance(got, bool):
        assert got == (value == "true"), setting
    elif isinstance(got, (int, float)):
        assert float(got) == float(value), setting
    else:
        assert str(got) == value, setting
