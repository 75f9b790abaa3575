"""LiveCodeBench code-generation records, read as they are published, into the code reward's
test formats (rewards/code.py; data/prompts.py reads a dataset's rows through it).

A release row keeps its tests as JSON strings: ``public_test_cases`` is a JSON list of
``{"input", "output", "testtype": "stdin" | "functional"}``; ``private_test_cases`` is the
same list either as JSON or (code_generation_lite) as base64 of zlib of a pickle of that JSON
string; ``metadata`` is a JSON string whose ``func_name`` names the method of call-based
(LeetCode) problems. Functional inputs are one JSON value per line (the arguments), outputs
one JSON value (LiveCodeBench's ``lcb_runner/evaluation/testing_util.py`` reads them so).

A dataset file is untrusted input, and unpickling runs whatever a pickle asks for. The
private tests are therefore decoded with :class:`StringsOnlyUnpickler`, which refuses every
global (class, function, ``os.system``) and persistent id, and the result must be a string.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import zlib
from typing import Any

LCB_FIELDS = ("public_test_cases", "private_test_cases")
MAX_DECOMPRESSED_BYTES = 1 << 30  # a zlib bomb stops here


class BadTestCases(ValueError):
    """LiveCodeBench test cases that cannot be read (or that are refused as unsafe)."""


class StringsOnlyUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only: any global lookup (the way a pickle reaches
    a class or a callable such as ``os.system``) and any persistent id is refused."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        raise pickle.UnpicklingError(f"refused: the pickle asks for the global {module}.{name}; "
                                     "a test-case pickle may hold a string only")

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102
        raise pickle.UnpicklingError("refused: the pickle asks for a persistent id")


def unpickle_string(data: bytes) -> str:
    """The string a pickle holds; :class:`BadTestCases` for anything else, executing nothing."""
    try:
        value = StringsOnlyUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, RecursionError) as exc:
        raise BadTestCases(f"private_test_cases: unsafe or broken pickle ({exc})") from None
    if not isinstance(value, str):
        raise BadTestCases(f"private_test_cases: the pickle holds a {type(value).__name__}, "
                            "not a JSON string")
    return value


def _inflate(data: bytes) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, MAX_DECOMPRESSED_BYTES)
    if inflater.unconsumed_tail:
        raise BadTestCases(f"private_test_cases: more than {MAX_DECOMPRESSED_BYTES} bytes "
                            "once decompressed")
    return out


def decode_test_cases(value: Any, name: str) -> list[dict]:
    """A test-case field as a list of ``{"input", "output", "testtype"}``: a list as it is,
    a JSON string, or base64(zlib(pickle(JSON string)))."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                raw = _inflate(base64.b64decode(value.encode("ascii"), validate=True))
            except (binascii.Error, UnicodeEncodeError, zlib.error) as exc:
                raise BadTestCases(f"{name}: neither JSON nor base64(zlib(pickle)) ({exc})"
                                    ) from None
            try:
                value = json.loads(unpickle_string(raw))
            except json.JSONDecodeError as exc:
                raise BadTestCases(f"{name}: the pickled string is not JSON ({exc.msg})") from None
    if not isinstance(value, list) or not all(
            isinstance(t, dict) and isinstance(t.get("input"), str)
            and isinstance(t.get("output"), str) for t in value):
        raise BadTestCases(f"{name}: expected a list of {{'input': str, 'output': str, "
                            "'testtype': ...}}")
    return value


def _func_name(metadata: Any) -> str | None:
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata.strip() else {}
        except json.JSONDecodeError:
            raise BadTestCases("metadata: not a JSON object") from None
    if metadata is not None and not isinstance(metadata, dict):
        raise BadTestCases("metadata: not a JSON object")
    return (metadata or {}).get("func_name") or None


def lcb_tests(rec: dict) -> dict | None:
    """The code-reward tests of a LiveCodeBench row (None when it has no test-case field):
    ``{"inputs", "outputs"}`` for stdin problems, plus ``fn_name`` (arguments decoded from
    their JSON lines, outputs from JSON) for functional ones."""
    if not any(k in rec for k in LCB_FIELDS):
        return None
    cases = [t for k in LCB_FIELDS if rec.get(k) not in (None, "")
             for t in decode_test_cases(rec[k], k)]
    if not cases:
        raise BadTestCases("public_test_cases/private_test_cases: no test cases")
    kinds = {t.get("testtype", "stdin") for t in cases}
    if kinds == {"stdin"}:
        return {"inputs": [t["input"] for t in cases], "outputs": [t["output"] for t in cases]}
    fn_name = _func_name(rec.get("metadata"))
    if kinds != {"functional"} or not fn_name:
        raise BadTestCases(f"test types {sorted(kinds)} with metadata.func_name {fn_name!r}: "
                            "functional tests need metadata.func_name, and a problem's tests "
                            "must be all stdin or all functional")
    try:
        inputs = [[json.loads(line) for line in t["input"].split("\n")] if t["input"] else []
                  for t in cases]
        outputs = [json.loads(t["output"]) for t in cases]
    except json.JSONDecodeError as exc:
        raise BadTestCases(f"functional test case is not JSON ({exc.msg})") from None
    return {"inputs": inputs, "outputs": outputs, "fn_name": fn_name}
