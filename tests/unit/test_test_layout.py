"""The test folders agree with the tiers tests/conftest.py infers (issue 52): no file under
tests/unit/ holds a slow test (multiprocess, interop or examples), every file under
tests/multiprocess/ holds at least one test that starts processes, and no test file sits at
tests/ top level (that is for shared helpers). Read with pytest's own collection, so the
markers are the ones ``pytest -m "not slow"`` selects by."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SLOW_TIERS, TESTS, TIER_FOLDERS, tier_folder


class _Tiers:
    """Plugin: each collected test's file and the tiers it is marked with."""

    def __init__(self) -> None:
        self.files: dict[Path, set[str]] = {}

    @pytest.hookimpl(trylast=True)   # after tests/conftest.py has set the markers
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            tiers = {t for t in SLOW_TIERS if item.get_closest_marker(t)}
            self.files.setdefault(item.path, set()).update(tiers)


def collected_tiers(*folders: Path) -> dict[Path, set[str]]:
    """The tiers of every test file under ``folders``, from a collect-only pytest session."""
    tiers = _Tiers()
    rc = pytest.main(["--collect-only", "-p", "no:cacheprovider", "-p", "no:terminal",
                      *map(str, folders)], plugins=[tiers])
    assert rc == pytest.ExitCode.OK, f"collecting {folders} failed (exit {rc})"
    return tiers.files


def layout_errors(files: dict[Path, set[str]]) -> list[str]:
    """Where a file's folder and its tests' tiers disagree, one line each."""
    errors = []
    for path, tiers in sorted(files.items()):
        where, name = tier_folder(path), path.relative_to(TESTS)
        if where == "unit" and tiers:
            home = next((t for t in ("examples", "interop") if t in tiers), "multiprocess")
            errors.append(f"{name}: has {sorted(tiers)} tests; move it to tests/{home}/")
        elif where == "multiprocess" and "multiprocess" not in tiers:
            errors.append(f"{name}: starts no processes; move it to tests/unit/")
    return errors


def test_folders_agree_with_the_inferred_tiers():
    files = collected_tiers(TESTS / "unit", TESTS / "multiprocess")
    assert {tier_folder(p) for p in files} == {"unit", "multiprocess"}
    assert layout_errors(files) == []


def test_test_files_live_in_a_tier_folder():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"test files at tests/ top level: {loose}; move each to one of " \
                        f"tests/{{{','.join(TIER_FOLDERS)}}}/"
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set(TIER_FOLDERS)
