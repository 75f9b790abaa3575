"""Binary math reward: 1.0 when the final answer is equivalent to the reference, else 0.0.

The answer is the last ``\\boxed{}`` after ``</think>`` (or, without a box, the final answer
math-verify finds in that text). Equivalence is math-verify's (integers with leading
zeros, fractions, decimals, LaTeX, intervals, sets).

math-verify's own timeouts use SIGALRM, which only works in a main thread, and sympy can
hang on adversarial input. So verification runs in worker processes (``python -m
megatron_klear.rewards.math``), each using math-verify's timeouts in its main thread; the
parent enforces a hard wall deadline per call and kills and replaces a worker that
overruns. Any failure scores 0.0; nothing here raises on garbage responses.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import resource
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from megatron_klear.heap import freeze_startup_heap
from megatron_klear.rewards.text import final_section, last_boxed

DEFAULT_TIMEOUT_S = 10.0  # hard wall limit per call (parse gold + parse answer + verify)
INNER_TIMEOUT_S = 3  # math-verify's own per-step timeout, inside the worker
KLEAR_TIMEOUT_S = 5  # the same in Klear's check (math_dapo.py)
MAX_TAIL_CHARS = 4000  # without a box, only the end of the response can hold the answer
WORKER_MEMORY_MB = 4096
WORKER_START_TIMEOUT_S = 300.0  # a worker's imports (math-verify, sympy), outside every deadline
_SCI = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")
PIPE_BYTES = 65536  # Linux's pipe capacity: a write that fits an empty pipe returns at once
_ARITH = re.compile(r"[\d\s.+\-*/()]+")
_INTEGER = re.compile(r"[+-]?\d{1,64}")  # longer: math-verify (int() caps digits)


def _answer_text(response: str) -> str | None:
    text = final_section(response)
    if text is None:
        return None
    boxed = last_boxed(text)
    return f"\\boxed{{{boxed}}}" if boxed is not None else text[-MAX_TAIL_CHARS:]


def plain_verdict(response: str, gold: str) -> float | None:
    """The score where it needs no verifier: 0.0 for a response with no final answer, and for
    a boxed integer against an integer reference their comparison as integers (math-verify's
    verdict on those, leading zeros and signs included); None where math-verify must decide.
    Integer answers are most of a math RL set, and this spares each a round trip to a
    verifier process."""
    text = final_section(response)
    if not text:
        return 0.0
    boxed = last_boxed(text)
    if boxed is None or not _INTEGER.fullmatch(boxed.strip()) or not _INTEGER.fullmatch(gold):
        return None
    return float(int(boxed) == int(gold))


def gold_text(answer: Any) -> str:
    """The reference answer as text; numbers from the data (amc23's 27.0) are accepted."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"math answer must be a string or a number, got {type(answer).__name__}")
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def _gold_source(gold: str) -> str:
    """The reference in the form math-verify parses best: plain arithmetic ("-1./3") as an
    expression, scientific notation ("4.5e33") as LaTeX, anything else as inline LaTeX."""
    if _SCI.fullmatch(gold):
        mant, exp = re.split("[eE]", gold)
        return f"${mant} \\times 10^{{{int(exp)}}}$"
    if _ARITH.fullmatch(gold) or "$" in gold:
        return gold
    return f"${gold}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """math-verify's parse of a reference answer: the n samples of a prompt share it, so it is
    parsed once per worker (sympy expressions are immutable; ``verify`` only reads them)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return tuple(parse(_gold_source(gold), parsing_timeout=INNER_TIMEOUT_S,
                       extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()]))


def verify_in_process(response: str, answer: Any) -> float:
    """The verification itself; must run in a main thread (math-verify uses SIGALRM)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    pred_text = _answer_text(response)
    if not pred_text:
        return 0.0
    gold = list(_parse_gold(gold_text(answer)))
    pred = parse(pred_text, extraction_config=[LatexExtractionConfig(boxed_match_priority=0),
                                               ExprExtractionConfig()],
                 parsing_timeout=INNER_TIMEOUT_S)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=INNER_TIMEOUT_S) else 0.0


def verify_klear(final: str, answers: list[str]) -> float:
    """Klear-Reasoner's math check (verl's math_dapo.py, rewards/klear.py's ``math_klear``):
    1.0 when the answer math-verify extracts from ``final`` (the text after ``</think>``) equals
    a reference string or is equivalent to ``\\boxed{reference}``, else 0.0; math-verify's own
    timeouts are 5 s. Must run in a main thread (SIGALRM)."""
    from math_verify import parse, verify

    try:
        pred = parse(final, parsing_timeout=KLEAR_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - unparsable: incorrect
        return 0.0
    if len(pred) < 2:
        return 0.0
    if pred[1] in answers:
        return 1.0
    for gold in answers:
        try:
            if verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=KLEAR_TIMEOUT_S), pred,
                      timeout_seconds=KLEAR_TIMEOUT_S):
                return 1.0
        except Exception:  # noqa: BLE001 - try the next reference
            continue
    return 0.0


# the worker's verification modes: name -> function(text, answer) -> 1.0 | 0.0
VERIFIERS = {"binary": verify_in_process, "klear": verify_klear}


def _serve() -> None:
    """Worker loop: one JSON [response, answer, mode] per stdin line -> one score per stdout
    line (modes: :data:`VERIFIERS`; any failure scores 0.0)."""
    import logging

    from megatron_klear.orphans import exit_when_orphaned

    exit_when_orphaned()  # a SIGKILLed trainer leaves no worker behind
    logging.disable(logging.CRITICAL)  # math-verify logs every parse failure
    limit = WORKER_MEMORY_MB << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    import math_verify  # noqa: F401 - imported before the freeze: sympy's heap stays out of it

    freeze_startup_heap()
    out.write("ready\n")  # imports done: the caller's deadlines start now, not at the spawn
    out.flush()
    for line in sys.stdin:
        try:
            response, answer, mode = json.loads(line)
            score = VERIFIERS[mode](response, answer)
        except Exception:  # noqa: BLE001 - garbage in, 0.0 out
            score = 0.0
        out.write(f"{score}\n")
        out.flush()


class _Worker:
    def __init__(self) -> None:
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_klear.rewards.math"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        # a job's deadline times the verification, never the worker's imports (seconds on a
        # loaded machine): a correct answer must not score 0 because the cores were busy
        try:
            ready = self.lines.get(timeout=WORKER_START_TIMEOUT_S)
        except queue.Empty:
            ready = ""
        if ready != "ready\n":
            self.kill()
            raise RuntimeError(f"the math verifier worker ({sys.executable} -m "
                               "megatron_klear.rewards.math) did not start within "
                               f"{WORKER_START_TIMEOUT_S} s; is math-verify installed?")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF: the worker died

    def send(self, jobs: list[tuple[str, Any]], mode: str) -> None:
        """Queue ``jobs`` (response, answer) on the worker: one write, from a thread, so a
        worker stuck on a job (its stdin full) cannot block the caller's deadlines."""
        text = "".join(json.dumps([response, answer, mode]) + "\n" for response, answer in jobs)

        def write() -> None:
            with contextlib.suppress(OSError, ValueError):  # killed meanwhile
                self.proc.stdin.write(text)
                self.proc.stdin.flush()
        if 4 * len(text) <= PIPE_BYTES:  # at most 4 UTF-8 bytes a character
            write()
        else:
            threading.Thread(target=write, daemon=True).start()

    def result(self, timeout_s: float) -> float | None:
        """The next job's score, or None when the worker overran or died (it is then
        unusable)."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None
        return float(line) if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class MathVerifierPool:
    """At most ``max_workers`` verifier processes, started on demand and reused."""

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers or max(1, len(os.sched_getaffinity(0)))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._slots = threading.Semaphore(self.max_workers)

    def score(self, response: str, answer: Any, timeout_s: float = DEFAULT_TIMEOUT_S, *,
              mode: str = "binary", failed: float = 0.0) -> float:
        """math_reward (``mode="binary"``; ``"klear"``: :func:`verify_klear` on a list of
        reference strings) through a worker with a hard deadline; ``failed`` on any
        failure."""
        return self.score_many([(response, answer)], timeout_s, mode=mode, failed=failed)[0]

    def score_many(self, items: list[tuple[Any, Any]], timeout_s: float = DEFAULT_TIMEOUT_S,
                   *, mode: str = "binary", failed: float = 0.0, workers: int | None = None,
                   done: Callable[[int], None] | None = None) -> list[float]:
        """:meth:`score` of each (response, answer) in order. The ones a verifier must decide
        go to at most ``workers`` (default ``max_workers``) workers as one run each, written
        at once, so a worker verifies back to back instead of waiting a round trip per
        response; each keeps its own ``timeout_s``. ``done(k)``: k more are scored."""
        scores: list[float | None] = [self._plain(r, a, mode, failed) for r, a in items]
        jobs = [(i, r, gold_text(a) if mode == "binary" else a)
                for i, ((r, a), v) in enumerate(zip(items, scores)) if v is None]
        if done is not None and len(jobs) < len(items):
            done(len(items) - len(jobs))
        parts = min(workers or self.max_workers, self.max_workers, len(jobs))
        runs = [jobs[k * len(jobs) // parts:(k + 1) * len(jobs) // parts] for k in range(parts)]

        def score_run(run: list[tuple[int, str, Any]]) -> None:
            for (i, _, _), score in zip(run, self._run([(r, g) for _, r, g in run], timeout_s,
                                                       mode, failed, done)):
                scores[i] = score
        if len(runs) == 1:
            score_run(runs[0])
        elif runs:
            with ThreadPoolExecutor(len(runs), thread_name_prefix="math-verify") as ex:
                list(ex.map(score_run, runs))
        return scores

    @staticmethod
    def _plain(response: Any, answer: Any, mode: str, failed: float) -> float | None:
        """The score where no verifier is needed (bad input, :func:`plain_verdict`)."""
        if not isinstance(response, str):
            return failed
        if mode != "binary":
            return None
        try:
            return plain_verdict(response, gold_text(answer))
        except TypeError:
            return failed

    def _run(self, jobs: list[tuple[str, Any]], timeout_s: float, mode: str, failed: float,
             done: Callable[[int], None] | None) -> list[float]:
        """``jobs`` through one worker in order: a job that overruns ``timeout_s`` (or kills
        the worker) scores ``failed``, and a fresh worker takes the rest."""
        out: list[float] = []
        with self._slots:
            worker = None
            while len(out) < len(jobs):
                if worker is None:
                    try:
                        worker = self._idle.get_nowait()
                    except queue.Empty:
                        worker = _Worker()
                worker.send(jobs[len(out):], mode)
                for _ in range(len(out), len(jobs)):
                    result = worker.result(timeout_s)
                    out.append(failed if result is None else result)
                    if done is not None:
                        done(1)
                    if result is None:  # unusable: a fresh one takes what is left, if any
                        worker.kill()
                        worker = None
                        break
            if worker is not None:
                self._idle.put(worker)
        return out

    def close(self) -> None:
        """Stop all idle workers."""
        while not self._idle.empty():
            self._idle.get_nowait().kill()


_shared: MathVerifierPool | None = None
_shared_lock = threading.Lock()


def shared_verifier() -> MathVerifierPool:
    """The process-wide verifier pool (one worker per core), created on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifierPool()
        return _shared


def math_reward(response: str, answer: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the response's final answer is equivalent to ``answer``, else 0.0.

    Safe from any thread; never hangs longer than ``timeout_s`` and never raises."""
    return shared_verifier().score(response, answer, timeout_s)


def _math_reward_many(responses: list[str], answers: list[Any], workers: int | None = None,
                      done: Callable[[int], None] | None = None) -> list[float]:
    """:func:`math_reward` of each pair, batched per worker (``score_batch`` uses it)."""
    return shared_verifier().score_many(list(zip(responses, answers)), workers=workers,
                                        done=done)


math_reward.score_many = _math_reward_many


if __name__ == "__main__":
    _serve()
