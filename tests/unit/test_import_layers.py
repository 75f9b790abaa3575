"""Every module of megatron_klear/ sits in one layer of :data:`LAYERS`, and no import climbs to a
higher layer (issues 39 and 52). The order is written once, here; a new package or top-level
module must be placed in it. Read from the source (function-local imports too)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "megatron_klear"

# bottom to top; a module may import its own layer and the layers below, never one above
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "platform", "virtual_cuda", "distributed", "heap", "import_path", "orphans",
     "samples", "_C"),
    ("ops",),                    # fused kernels and the loss math they are tested against
    ("models",),
    ("rewards",),
    ("data",),                   # reads LiveCodeBench rows and boxed answers through rewards/
    ("algo",),
    ("checkpoint",),
    ("rollout.orchestration",),  # the request contract, client, pipeline stages, tools
    ("rollout.transport",),      # weight sync to the servers (speaks through the client)
    ("rollout.engine",),         # the embedded server (receives through the transport)
    ("cli",),
    ("eval",),
    ("train",),
    ("quickstart",),
)


def layer_of(module: str) -> int | None:
    """The layer index of a dotted ``megatron_klear.*`` module (None: the package faces
    ``megatron_klear`` and ``megatron_klear.rollout``, or a module outside the project)."""
    if not module.startswith("megatron_klear."):
        return None
    rest = module[len("megatron_klear."):]
    for index, layer in enumerate(LAYERS):
        if any(rest == unit or rest.startswith(unit + ".") for unit in layer):
            return index
    return None


def imported_modules(source: str) -> set[str]:
    """Every module a source imports, at any depth (function-local imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def climbing(module: str, source: str) -> list[str]:
    """The imports of ``source`` (module ``module``) that reach a layer above its own."""
    own = layer_of(module)
    if own is None:  # the package faces load before their modules: the bottom layer only
        own = 0
    return sorted(m for m in imported_modules(source)
                  if (layer := layer_of(m)) is not None and layer > own)


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    faces = {"megatron_klear", "megatron_klear.rollout"}
    unplaced = [module_name(p) for p in _sources()
                if module_name(p) not in faces and layer_of(module_name(p)) is None]
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_no_import_climbs_a_layer():
    bad = {module_name(p): got for p in _sources()
           if (got := climbing(module_name(p), p.read_text()))}
    assert not bad, f"imports above their layer: {bad}"


def test_the_check_sees_a_planted_upward_import():
    """The control: an upward import planted into a module of each package is reported."""
    for path in [PKG / "config.py", *sorted(PKG.glob("*/__init__.py")),
                 *sorted((PKG / "rollout").glob("*/__init__.py"))]:
        module = module_name(path)
        if module == "megatron_klear.rollout" or layer_of(module) is None:
            continue
        above = next((LAYERS[i][0] for i in range(layer_of(module) + 1, len(LAYERS))), None)
        if above is None:
            continue
        planted = path.read_text() + f"\nfrom megatron_klear.{above} import anything\n"
        assert climbing(module, planted), f"{module}: a planted import of {above} passed"


def test_engine_and_converter_share_lower_layers_only():
    """train/engine.py takes the HF reader and export from checkpoint/hf_io.py, not from the
    converter; the converter takes the parallel setup, model build and CP slicing from below."""
    engine = imported_modules((PKG / "train" / "engine.py").read_text())
    assert "megatron_klear.checkpoint.convert" not in engine
    assert "megatron_klear.checkpoint.hf_io" in engine
    convert = imported_modules((PKG / "checkpoint" / "convert.py").read_text())
    assert {"megatron_klear.distributed", "megatron_klear.models.context_parallel_layout"} \
        <= convert


def test_math_and_klear_rewards_are_one_way():
    assert "megatron_klear.rewards.math" in \
        imported_modules((PKG / "rewards" / "klear.py").read_text())
    assert "megatron_klear.rewards.klear" not in \
        imported_modules((PKG / "rewards" / "math.py").read_text())
