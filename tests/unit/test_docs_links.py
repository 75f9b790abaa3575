"""The docs as a map (issue 52): every relative link in README.md and docs/*.md reaches a file
(and, with ``#anchor``, a heading of it), every ``docs/NAME.md`` a page names exists, the README
stays a short page, and each benchmark's ``--update-docs`` block has its markers in
docs/results.md (benchmarks/results_doc.py writes between them)."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES, MAX_LINE_CHARS = 160, 200


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link there is not one)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped, each
    space a hyphen."""
    kept = (c for c in heading.strip().lower()
            if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
    return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n)}


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: -- not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    """A moved or renamed page or heading breaks no link of the map."""
    assert not broken_links(page), f"{page.relative_to(ROOT)}: fix these links"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_doc_pages_exist(page: Path):
    """Plain mentions such as docs/rollout.md name pages that exist."""
    missing = {m for m in re.findall(r"docs/([A-Za-z0-9_]+\.md)", page.read_text())
               if not (ROOT / "docs" / m).exists()}
    assert not missing, f"{page.relative_to(ROOT)} names missing pages: {sorted(missing)}"


def test_readme_is_a_map():
    """The README stays a short page with short lines (measurements go to docs/results.md)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_LINE_CHARS]
    assert not long, f"README.md lines over {MAX_LINE_CHARS} characters: {long}"


def test_every_doc_page_is_in_the_index():
    """docs/README.md links every page of docs/."""
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(index)}
    pages = {p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"}
    assert not pages - linked, f"docs/README.md does not list {sorted(pages - linked)}"


def _results_doc():
    """benchmarks/results_doc.py (benchmarks/ is no package: loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "results_doc", ROOT / "benchmarks" / "results_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_benchmark_block_has_its_markers_in_results():
    """Every ``write_block("NAME", ...)`` of benchmarks/ finds its markers once in results.md."""
    results_doc = _results_doc()
    names = {n for f in (ROOT / "benchmarks").glob("*.py")
             for n in re.findall(r'write_block\("([a-z_]+)"', f.read_text())}
    assert names >= {"bench_vs_trl", "bench_cpu_gemm"}
    text = results_doc.RESULTS.read_text()
    for name in names:
        for marker in results_doc.markers(name):
            assert text.count(marker) == 1, f"docs/results.md: {marker} missing or repeated"


def test_write_block_replaces_only_its_block(tmp_path):
    """The block between the markers is replaced, the rest kept; a page without the markers
    is refused by name, not written."""
    results_doc = _results_doc()
    page = tmp_path / "results.md"
    begin, end = results_doc.markers("bench_x")
    page.write_text(f"# R\n\nbefore\n{begin}\nold\n{end}\nafter\n")
    results_doc.write_block("bench_x", "new table", page)
    assert page.read_text() == f"# R\n\nbefore\n{begin}\nnew table\n{end}\nafter\n"
    with pytest.raises(ValueError, match="bench_y:begin"):
        results_doc.write_block("bench_y", "text", page)
    assert "new table" in page.read_text()


def test_results_entries_are_dated_newest_first():
    """Each entry of docs/results.md opens with its date and commit, newest entry first."""
    entries = (ROOT / "docs" / "results.md").read_text().split("\n## ")[1:]
    dates = []
    for entry in entries:
        title, _, body = entry.partition("\n")
        first = body.strip().split("\n\n")[0]
        m = re.match(r"(\d{4}-\d{2}-\d{2})\b", first)
        assert m and re.search(r"\b[0-9a-f]{7}\b", first), \
            f"docs/results.md ## {title}: open with 'YYYY-MM-DD, <commit>'"
        dates.append(m.group(1))
    assert dates == sorted(dates, reverse=True), f"docs/results.md: entries not newest first: {dates}"
