"""math_reward on real problems (gsm8k, amc23, minerva): equivalent forms of the reference
answer score 1.0, wrong answers 0.0; garbage never raises; the hard timeout works."""

import os
import threading
import time

import pytest

from megatron_klear.data.prompts import load_prompt_dataset
from megatron_klear.rewards.math import MathVerifierPool, math_reward

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def _gsm8k():
    return load_prompt_dataset(os.path.join(DATA, "gsm8k_test_20.jsonl"), prompt_key="question",
                               answer_format="gsm8k")


def _minerva(answer: str) -> str:
    samples = load_prompt_dataset(os.path.join(DATA, "minerva_math_40.jsonl"), prompt_key="problem",
                                  answer_key="solution", answer_format="boxed")
    labels = [s.label for s in samples]
    assert answer in labels, f"{answer!r} not among minerva labels"
    return answer


def _integer_forms(n: int) -> list[str]:
    return [f"\\boxed{{{n}}}", f"So the answer is $\\boxed{{0{n}}}$.", f"\\boxed{{{n}.0}}",
            f"\\boxed{{\\frac{{{2 * n}}}{{2}}}}", f"\\boxed{{\\dfrac{{{3 * n}}}{{3}}}}",
            f"<think>maybe \\boxed{{{n + 1}}}? no.</think>\nThe final answer is \\boxed{{{n}}}",
            f"The final answer is {n}"]


def test_gsm8k_equivalent_forms_score_one_and_wrong_zero():
    samples = _gsm8k()[:8]
    for s in samples:
        n = int(s.label)
        for resp in _integer_forms(n):
            assert math_reward(resp, s.label) == 1.0, (resp, s.label)
        for wrong in [f"\\boxed{{{n + 1}}}", f"\\boxed{{{n}}} \\boxed{{{n + 2}}}",
                      f"<think>\\boxed{{{n}}}</think> so \\boxed{{{n - 1}}}",
                      f"<think>truncated \\boxed{{{n}}}"]:
            assert math_reward(wrong, s.label) == 0.0, (wrong, s.label)


def test_amc23_numeric_labels():
    samples = load_prompt_dataset(os.path.join(DATA, "amc23.jsonl"), prompt_key="problem")
    assert isinstance(samples[0].label, float)  # 27.0 in the data
    for s in samples[:6]:
        n = int(s.label)
        assert math_reward(f"\\boxed{{{n}}}", s.label) == 1.0
        assert math_reward(f"\\boxed{{{n}.00}}", s.label) == 1.0
        assert math_reward(f"\\boxed{{{n + 3}}}", s.label) == 0.0


@pytest.mark.parametrize("answer,right,wrong", [
    ("\\frac{a M^{1 / 3}}{G M^{2 / 3}+b}", "\\dfrac{aM^{1/3}}{b+GM^{2/3}}",
     "\\frac{a M^{1/3}}{G M^{2/3}-b}"),
    ("4.5e33", "4.5 \\times 10^{33}", "4.5 \\times 10^{32}"),
    ("-1./3", "-\\frac{1}{3}", "\\frac{1}{3}"),
    ("\\sqrt{4 \\pi G \\rho_{0} r_{0}^{2}}", "2\\sqrt{\\pi G\\rho_0 r_0^2}", "\\sqrt{4 \\pi G \\rho_0 r_0}"),
])
def test_minerva_latex_answers(answer, right, wrong):
    gold = _minerva(answer)
    assert math_reward(f"Thus \\boxed{{{right}}}.", gold) == 1.0
    assert math_reward(f"Thus \\boxed{{{wrong}}}.", gold) == 0.0


@pytest.mark.parametrize("gold,right,wrong", [
    ("(1, 2]", "\\boxed{(1,2]}", "\\boxed{[1,2]}"),
    ("\\{1, 3\\}", "\\boxed{\\{3, 1\\}}", "\\boxed{\\{1, 2\\}}"),
    ("0.5", "\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{3}}"),
    ("\\frac{3}{4}", "\\boxed{0.75}", "\\boxed{0.74}"),
])
def test_intervals_sets_fractions_decimals(gold, right, wrong):
    assert math_reward(right, gold) == 1.0
    assert math_reward(wrong, gold) == 0.0


@pytest.mark.parametrize("garbage", [None, 17, "", "\\boxed{" * 2000, "}" * 5000,
                                     "\\boxed{\\frac{1}{0}}", "\x00\xff" * 100,
                                     "\\boxed{" + "(" * 500 + "}", "a" * 200_000])
def test_garbage_never_raises(garbage):
    assert math_reward(garbage, "3") == 0.0


def test_hard_timeout_kills_and_replaces_worker():
    pool = MathVerifierPool(max_workers=1)
    try:
        # decimals, not integers: those are decided without a worker (plain_verdict)
        assert pool.score("\\boxed{5.0}", "5") == 1.0  # warm worker
        start = time.monotonic()
        assert pool.score("\\boxed{5.0}", "5", timeout_s=0.0) == 0.0  # deadline passed
        assert time.monotonic() - start < 1.0
        assert pool.score("\\boxed{6.0}", "6") == 1.0  # a fresh worker took over
    finally:
        pool.close()


def test_batched_scores_keep_each_deadline_and_go_on_after_an_overrun():
    """score_many sends a worker its whole run at once: a response that overruns its own
    deadline (sympy on a tower of powers runs into math-verify's 3 s inner timeout) scores
    0.0, its worker is replaced, and the responses after it are still verified, in order."""
    pool = MathVerifierPool(max_workers=1)
    slow = "\\boxed{9^{9^{9^{9}}}}"
    items = [("\\boxed{5.0}", "5"), (slow, "5"), ("\\boxed{6.0}", "6"), ("\\boxed{7.5}", "7"),
             (None, "1"), ("\\boxed{8}", "8")]
    ticks = []  # (when, how many) of each done() call
    try:
        scores = pool.score_many(items, timeout_s=1.0,
                                 done=lambda k: ticks.append((time.monotonic(), k)))
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    # the slow one took at most its 1 s deadline, not math-verify's 3 s (timed from the
    # answer before it: the workers' start-ups are outside every deadline)
    gap = ticks[1][0] - ticks[0][0]
    assert gap < 2.5, gap
    assert sum(k for _, k in ticks) == len(items)


def test_a_workers_start_up_is_outside_the_deadline(tmp_path, monkeypatch):
    """A fresh worker's imports (seconds on a loaded machine) do not count against the first
    answer's deadline: with a start-up made 3 s long (a sitecustomize that sleeps), a correct
    answer under a 1 s deadline still scores 1.0."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    pool = MathVerifierPool(max_workers=1)
    try:
        start = time.monotonic()
        assert pool.score("\\boxed{5.0}", "5", timeout_s=1.0) == 1.0
        assert time.monotonic() - start > 3.0  # the slow start-up really happened
    finally:
        pool.close()


def test_a_run_larger_than_a_pipe_is_written_whole():
    """A worker's run of long responses (more than a pipe holds) is written from a thread
    while the worker reads it; every response comes back scored, in order."""
    pool = MathVerifierPool(max_workers=2)
    items = [("x " * 2000 + f"\\boxed{{{n}.0}}", str(n + n % 2)) for n in range(40)]
    try:
        assert pool.score_many(items) == [float(n % 2 == 0) for n in range(40)]
    finally:
        pool.close()


def test_works_from_worker_threads():
    """math-verify's SIGALRM timeouts fail outside the main thread; ours must not."""
    out = []
    threads = [threading.Thread(target=lambda n=n: out.append(math_reward(f"\\boxed{{{n}}}", str(n))))
               for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [1.0] * 4


def test_cached_reference_parse_gives_the_same_verdicts():
    """The n samples of a prompt share one parse of the reference (per worker): verdicts
    against the cached parse equal those of the first, uncached call, in either order."""
    from megatron_klear.rewards.math import _parse_gold, verify_in_process

    _parse_gold.cache_clear()
    gold = "\\frac{3}{4}"
    verdicts = [verify_in_process(r, gold) for r in
                ("\\boxed{0.75}", "\\boxed{3/5}", "\\boxed{\\dfrac{6}{8}}", "\\boxed{4/3}")]
    assert verdicts == [1.0, 0.0, 1.0, 0.0]
    assert _parse_gold.cache_info().hits == 3



@pytest.mark.parametrize("response,gold,quick", [
    ("\\boxed{14}", "14", 1.0), ("\\boxed{014}", "14", 1.0), ("\\boxed{ 14 }", "14", 1.0),
    ("\\boxed{+14}", "14", 1.0), ("\\boxed{-3}", "-3", 1.0), ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{13}", "14", 0.0), ("<think>\\boxed{14}</think> so \\boxed{15}", "14", 0.0),
    ("<think>cut \\boxed{14}", "14", 0.0), ("", "14", 0.0),
    # the verifier decides: no box, or not two integers
    ("The answer is 14", "14", None), ("\\boxed{14}", "14.5", None),
    ("\\boxed{14.0}", "14", None), ("\\boxed{7/2}", "3", None),
    ("\\boxed{" + "9" * 80 + "}", "9" * 80, None)])
def test_plain_verdict_is_math_verifys(response, gold, quick):
    """Where the pool skips the verifier process (no final answer; a boxed integer against an
    integer) its verdict is math-verify's own (verify_in_process); elsewhere it defers."""
    from megatron_klear.rewards.math import plain_verdict, verify_in_process

    assert plain_verdict(response, gold) == quick
    if quick is not None:
        assert quick == verify_in_process(response, gold)
    assert math_reward(response, gold) == verify_in_process(response, gold)
