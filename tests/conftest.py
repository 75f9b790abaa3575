"""The suite's tiers: markers set at collection, so ``pytest -m "not slow"`` runs in minutes.

- ``examples``: tests/examples/ (the example scripts and README commands, run as written: every
  test there starts bash or a trainer);
- ``interop``: tests/interop/ (real SGLang servers from .venv-sglang);
- ``multiprocess``: a test that starts processes -- gloo ranks (tests/dist.py), a trainer,
  converter or eval CLI, an embedded server -- found from the code it runs: the test function,
  the fixtures it uses and the tests/ helpers they call, transitively (names such as
  ``run_distributed``, ``subprocess``, ``launch_embedded_servers``). A test that starts
  processes some other way takes an explicit ``@pytest.mark.multiprocess``;
- ``slow``: any of the three.

The folders follow the tiers (:data:`TIER_FOLDERS`): tests/unit/ holds files none of whose tests
is slow, tests/multiprocess/ the files where processes take most of the time (a test there
that starts none is still unmarked, so ``-m "not slow"`` runs it); tests/unit/test_test_layout.py
checks that the folders and the markers agree. Shared helpers stay at tests/ top level.

Each process start costs ~5 s of imports on 2 cores, so these hold nearly all of the time.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import CodeType, FunctionType

import pytest

SLOW_TIERS = ("multiprocess", "interop", "examples")
TESTS = Path(__file__).resolve().parent
# the folders of test files, one per tier; interop/ and examples/ mark every test under them
TIER_FOLDERS = ("unit", "multiprocess", "interop", "examples")
RUN_ORDER = ("interop", "examples", "multiprocess", "unit", None)
# names whose use in a test's code means it starts processes
LAUNCHERS = frozenset({"run_distributed", "subprocess", "Popen", "launch_embedded_servers",
                       "launch_sglang_servers", "start_sglang", "launch_nodes",
                       "get_context"})


def _names(code: CodeType) -> set[str]:
    """Global and attribute names used by ``code`` and the lambdas, comprehensions and
    nested functions inside it."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _starts_processes(fn: object, seen: set[CodeType]) -> bool:
    """Whether ``fn``, or a function of tests/ that it names, uses one of LAUNCHERS."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not isinstance(fn, FunctionType) or fn.__code__ in seen:
        return False
    seen.add(fn.__code__)
    names = _names(fn.__code__)
    if names & LAUNCHERS:
        return True
    for name in names:
        obj = fn.__globals__.get(name)
        if isinstance(obj, FunctionType) and obj.__module__.startswith("tests"):
            if _starts_processes(obj, seen):
                return True
    return False


def _uses_processes(item: pytest.Item) -> bool:
    seen: set[CodeType] = set()
    if _starts_processes(getattr(item, "function", None), seen):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if any(_starts_processes(d.func, seen) for d in defs):
            return True
    return False


def tier_folder(path: Path) -> str | None:
    """The tier folder under tests/ that holds ``path`` (None: top level or outside tests/)."""
    try:
        first = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIER_FOLDERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = tier_folder(item.path)
        if folder in ("interop", "examples"):
            item.add_marker(getattr(pytest.mark, folder))
        if not item.get_closest_marker("multiprocess") and _uses_processes(item):
            item.add_marker(pytest.mark.multiprocess)
        if any(item.get_closest_marker(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
    # the heaviest tiers first (a stable sort: files and tests keep their order within a
    # tier), so the two xdist workers, one file each (pytest.ini), finish on the short
    # in-process files rather than one idling while the other starts SGLang
    items.sort(key=lambda item: RUN_ORDER.index(tier_folder(item.path)))
