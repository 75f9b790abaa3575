"""Atomic writers for data tools: output appears complete or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable


def _atomic(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_records(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write records as .jsonl or .parquet (by extension), atomically."""
    path = os.fspath(path)
    records = list(records)
    if path.endswith(".jsonl"):
        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    elif path.endswith(".parquet"):
        def write(tmp: str) -> None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), tmp)
    else:
        raise ValueError(f"{path}: output must end in .jsonl or .parquet")
    _atomic(path, write)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    _atomic(os.fspath(path), write)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write a JSON report atomically."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, ensure_ascii=False)
            f.write("\n")
    _atomic(os.fspath(path), write)
