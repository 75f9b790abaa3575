"""Code rewards: soft (``code``: the fraction of test cases the response's program passes)
and hard (``code_hard``: 1 only when it passes them all, as a LiveCodeBench verdict).

The program is the last fenced python block after ``</think>``. Supported test formats:

- stdin/stdout (APPS/TACO/LiveCodeBench): ``{"inputs": [...], "outputs": [...]}``; one run
  per case, output compared whitespace-tolerantly in this process.
- call-based (LeetCode): ``{"fn_name": ..., "inputs": [[args]], "outputs": [...]}``; the
  function (or ``Solution().fn_name``) is called in the sandbox and its ``repr`` compared
  here as a Python literal with the expected value.
- LiveCodeBench rows as published (``public_test_cases``/``private_test_cases`` JSON or
  base64-zlib-pickle strings, ``metadata.func_name``): read into one of the two above by
  :func:`megatron_klear.rewards.livecodebench.lcb_tests` (pickles: plain strings only).
- HumanEval: ``{"test": "...def check(candidate)...", "entry_point": ..., "context": prompt}``;
  every top-level statement of ``check`` that asserts about ``candidate`` is one case. Each
  case runs in the sandbox with a recording ``candidate``; then the trusted test code is
  replayed in a separate sandbox without the solution (see code_harness.py).

Every case runs in its own sandbox, so no print, exit code or monkey-patching of the
program can vouch for another case, and every verdict is decided outside the program.
"""

from __future__ import annotations

import ast
import copy
import json
import logging
import os
from typing import Any, Callable

from megatron_klear.rewards.livecodebench import lcb_tests
from megatron_klear.rewards.sandbox import SandboxJob, SandboxLimits, SandboxPool, SandboxResult, shared_pool
from megatron_klear.rewards.text import last_python_block

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 3.0  # CPU seconds per run of the program (SandboxLimits.cpu_bound)
DEFAULT_MEMORY_MB = 512
MAX_LITERAL_CHARS = 1 << 20
_HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_harness.py")
with open(_HARNESS_PATH) as _f:
    HARNESS_SOURCE = _f.read()


def test_format(tests: dict) -> str:
    """'humaneval', 'call' or 'stdio'; ValueError naming the expected fields otherwise."""
    if not isinstance(tests, dict):
        raise ValueError(f"code tests must be a dict, got {type(tests).__name__}")
    if "test" in tests and "entry_point" in tests:
        return "humaneval"
    if "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("code tests: 'inputs' and 'outputs' differ in length")
        return "call" if tests.get("fn_name") else "stdio"
    raise ValueError("code tests need 'test'+'entry_point' (HumanEval) or 'inputs'+'outputs' "
                     f"(+'fn_name' for call-based); got keys {sorted(tests)}")


def _literal(text: Any) -> tuple[bool, Any]:
    """Parse an untrusted repr as a plain Python literal (never evaluates code)."""
    if not isinstance(text, str) or len(text) > MAX_LITERAL_CHARS:
        return False, None
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _result_json(res: SandboxResult) -> dict:
    try:
        obj = json.loads(res.result) if res.result else {}
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _as_text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def stdout_matches(got: str, expected: str) -> bool:
    """Equal line by line after stripping each line and blank trailing lines, or equal as
    whitespace-separated token sequences."""
    if [ln.strip() for ln in got.strip().splitlines()] == \
            [ln.strip() for ln in expected.strip().splitlines()]:
        return True
    return got.split() == expected.split()


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def value_matches(got: Any, expected: Any) -> bool:
    """Call-based comparison: tuples compare as lists (JSON has no tuples), and an expected
    value wrapped in a one-element list (the TACO convention) matches its element."""
    got, expected = _plain(got), _plain(expected)
    if type(got) is bool or type(expected) is bool:  # True == 1 must not pass
        return type(got) is type(expected) and got == expected
    return got == expected or (isinstance(expected, list) and len(expected) == 1
                               and value_matches(got, expected[0]))


def _stdio(code: str, tests: dict, limits: SandboxLimits, pool: SandboxPool) -> list[bool]:
    jobs = [SandboxJob({"main.py": code}, "main.py", stdin=_as_text(inp).encode(), limits=limits)
            for inp in tests["inputs"]]
    return [res.ok and stdout_matches(res.stdout.decode(errors="replace"), _as_text(exp))
            for res, exp in zip(pool.map(jobs), tests["outputs"])]


def _call(code: str, tests: dict, limits: SandboxLimits, pool: SandboxPool) -> list[bool]:
    jobs = [SandboxJob({"solution.py": code, "harness.py": HARNESS_SOURCE,
                        "case.json": json.dumps(args if isinstance(args, list) else [args])},
                       "harness.py", ("call", str(tests["fn_name"])), limits=limits)
            for args in tests["inputs"]]
    verdicts = []
    for res, exp in zip(pool.map(jobs), tests["outputs"]):
        ok, got = _literal(_result_json(res).get("result")) if res.ok else (False, None)
        verdicts.append(ok and value_matches(got, exp))
    return verdicts


def _contains(node: ast.AST, kind: type, name: str | None = None) -> bool:
    return any(isinstance(n, kind) and (name is None or n.id == name) for n in ast.walk(node))


def humaneval_cases(test: str) -> list[str]:
    """Split a HumanEval ``check(candidate)`` into one function source per test case.

    A case is a top-level statement of ``check`` that contains an assert and uses the
    candidate; it is preceded by every assert-free statement before it (its setup).
    Asserts that never touch the candidate (``assert True``) test nothing and are dropped."""
    module = ast.parse(test)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks or not checks[-1].args.args:
        raise ValueError("HumanEval test has no 'def check(candidate)'")
    check = checks[-1]
    arg = check.args.args[0].arg
    cases = []
    for i, stmt in enumerate(check.body):
        if _contains(stmt, ast.Assert) and _contains(stmt, ast.Name, arg):
            fn = copy.copy(check)
            fn.name, fn.decorator_list = "__klear_case__", []
            fn.body = [s for s in check.body[:i] if not _contains(s, ast.Assert)] + [stmt]
            cases.append(ast.unparse(ast.fix_missing_locations(ast.Module([fn], []))))
    if not cases:
        raise ValueError("HumanEval test has no assert that uses the candidate")
    return cases


def _record_job(code: str, tests: dict, cases: list[str], limits: SandboxLimits) -> SandboxJob:
    return SandboxJob({"solution.py": code, "harness.py": HARNESS_SOURCE,
                       "case.json": json.dumps({"test": tests["test"], "cases": cases})},
                      "harness.py", ("record", str(tests["entry_point"])), limits=limits)


def _recorded_calls(res: SandboxResult) -> list:
    calls = _result_json(res).get("calls")
    return calls if isinstance(calls, list) else []


def _humaneval_records(code: str, tests: dict, cases: list[str], limits: SandboxLimits,
                       pool: SandboxPool) -> list:
    """Per-case call records: all cases in one sandbox first (the fast path for working
    programs); cases that run did not finish are then run one sandbox each."""
    records = _recorded_calls(pool.map([_record_job(code, tests, cases, limits)])[0])[:len(cases)]
    rest = cases[len(records):]
    if rest:
        singles = pool.map([_record_job(code, tests, [case], limits) for case in rest])
        records += [(_recorded_calls(res) or [[]])[0] for res in singles]
    return records


def _humaneval(code: str, tests: dict, limits: SandboxLimits, pool: SandboxPool) -> list[bool]:
    cases = humaneval_cases(tests["test"])
    records = _humaneval_records(code, tests, cases, limits, pool)
    if not any(records):
        return [False] * len(cases)
    spec = {"cases": cases, "records": records, "test": tests["test"],
            "entry_point": str(tests["entry_point"]), "context": tests.get("context")}
    replay_limits = SandboxLimits.cpu_bound(limits.cpu_s + 0.5 * len(cases), memory_mb=1024,
                                            output_bytes=limits.output_bytes)
    res = pool.map([SandboxJob({"harness.py": HARNESS_SOURCE, "replay.json": json.dumps(spec)},
                               "harness.py", ("replay",), limits=replay_limits)])[0]
    verdicts = _result_json(res).get("verdicts")
    if not (res.ok and isinstance(verdicts, list) and len(verdicts) == len(cases)):
        log.warning("HumanEval replay failed (entry point %s): %r", tests["entry_point"],
                    res.stderr[-2000:])
        return [False] * len(cases)
    return [v is True for v in verdicts]


_RUNNERS: dict[str, Callable[[str, dict, SandboxLimits, SandboxPool], list[bool]]] = {
    "stdio": _stdio, "call": _call, "humaneval": _humaneval}


def _compiles(code: str) -> bool:
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError):
        return False


def case_verdicts(response: str, tests: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                  memory_mb: int = DEFAULT_MEMORY_MB, pool: SandboxPool | None = None) -> list[bool]:
    """Pass/fail of every test case (all False when there is no runnable program)."""
    tests = lcb_tests(tests) or tests if isinstance(tests, dict) else tests
    kind = test_format(tests)
    code = last_python_block(response) if isinstance(response, str) else None
    if not code or not code.strip() or not _compiles(code):
        n = len(humaneval_cases(tests["test"])) if kind == "humaneval" else len(tests["inputs"])
        return [False] * n
    limits = SandboxLimits.cpu_bound(timeout_s, memory_mb=memory_mb)
    return _RUNNERS[kind](code, tests, limits, pool or shared_pool())


def code_reward(response: str, tests: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                memory_mb: int = DEFAULT_MEMORY_MB, pool: SandboxPool | None = None) -> float:
    """passed / total test cases of the last python block of ``response``, each case run in
    its own sandbox with ``timeout_s`` CPU seconds and ``memory_mb`` address space. CPU time,
    not wall time, decides, so a verdict does not change with the machine's load."""
    verdicts = case_verdicts(response, tests, timeout_s=timeout_s, memory_mb=memory_mb, pool=pool)
    return sum(verdicts) / len(verdicts) if verdicts else 0.0


def code_reward_hard(response: str, tests: dict, **kw: Any) -> float:
    """1.0 when the program passes every test case, else 0.0: the hard reward of
    Klear-Reasoner's section 5.2.3, which gives a partially correct program no credit (the soft
    :func:`code_reward` gives it its pass rate); ``kw`` as :func:`code_reward`'s."""
    verdicts = case_verdicts(response, tests, **kw)
    return float(bool(verdicts) and all(verdicts))
