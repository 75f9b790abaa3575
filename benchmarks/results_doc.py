"""The one writer of benchmark blocks in docs/results.md.

A benchmark with ``--update-docs`` replaces the text between its two markers
(``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``) and leaves the rest of the page as it was;
the page is replaced atomically, so an interrupted write leaves the old page whole.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of the block ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_block(name: str, text: str, path: Path = RESULTS) -> None:
    """Put ``text`` between the markers of ``name`` in ``path``; refuse a page that does not
    hold each marker exactly once (nowhere to write, or an ambiguous place)."""
    begin, end = markers(name)
    doc = path.read_text()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise ValueError(f"{path}: needs one {begin} before one {end}; restore the markers")
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(f"{head}{begin}\n{text}\n{end}{tail}")
    os.replace(tmp, path)
