"""No import climbs back to a higher layer and no module pair imports each other (issue 39):
train/ may import rollout/, data/, algo/, models/, ops/, rewards/, checkpoint/; those never
import train/ or the CLI; rewards/ is below data/ (data/prompts.py reads LiveCodeBench rows
and boxed answers through rewards/). Read from the source (function-local imports too)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "megatron_klear"


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (function-local imports too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_engine_and_converter_share_lower_layers_only():
    """train/engine.py takes the HF reader and export from checkpoint/hf_io.py, and the
    converter takes the parallel setup (distributed.py), the model build (models/qwen3.py) and
    the CP slicing (models/context_parallel_layout.py) from below the trainer: no module of
    checkpoint/ imports train/ (issue 39), so there is no circle either."""
    engine = _imported_modules(PKG / "train" / "engine.py")
    assert "megatron_klear.checkpoint.convert" not in engine
    assert "megatron_klear.checkpoint.hf_io" in engine
    for path in (PKG / "checkpoint").glob("*.py"):
        got = _climbing(path, ("megatron_klear.train", "megatron_klear.cli"))
        assert not got, f"checkpoint/{path.name} imports {sorted(got)}"
    convert = _imported_modules(PKG / "checkpoint" / "convert.py")
    assert {"megatron_klear.distributed", "megatron_klear.models.context_parallel_layout"} \
        <= convert  # the control: the scan sees the converter's imports


def _climbing(path: Path, above: tuple[str, ...]) -> set[str]:
    return {m for m in _imported_modules(path) if m.startswith(above)}


def test_rewards_import_nothing_above_them_and_math_klear_is_one_way():
    for path in (PKG / "rewards").glob("*.py"):
        got = _climbing(path, ("megatron_klear.data", "megatron_klear.train",
                               "megatron_klear.rollout", "megatron_klear.cli"))
        assert not got, f"rewards/{path.name} imports {sorted(got)}"
    assert "megatron_klear.rewards.math" in _imported_modules(PKG / "rewards" / "klear.py")
    assert not _climbing(PKG / "rewards" / "math.py", ("megatron_klear.rewards.klear",))
    # the control: data/ does read through rewards/
    assert "megatron_klear.rewards.livecodebench" in _imported_modules(PKG / "data" / "prompts.py")


def test_the_rollout_pipeline_knows_nothing_of_the_trainer():
    for path in (PKG / "rollout").rglob("*.py"):
        got = _climbing(path, ("megatron_klear.train", "megatron_klear.cli"))
        assert not got, f"{path.relative_to(PKG)} imports {sorted(got)}"
    assert "megatron_klear.rollout.orchestration.pipeline" in \
        _imported_modules(PKG / "train" / "rl_data.py")
