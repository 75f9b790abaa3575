"""Reward throughput: math rewards/s and code test-cases/s, 1 worker vs N side by side.

    python benchmarks/bench_rewards.py --workers 1 2

Math: gsm8k answers in mixed right/wrong boxed forms through the verifier pool. Code: the
100 HumanEval canonical solutions (every test case of every problem, each program in its
own sandbox: one record run + one trusted replay per problem) and a stdin/stdout task.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_klear.data.prompts import code_tests, load_prompt_dataset
from megatron_klear.rewards.code import code_reward, humaneval_cases
from megatron_klear.rewards.math import MathVerifierPool
from megatron_klear.rewards.sandbox import SandboxJob, SandboxPool, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def bench_math(workers: int, n: int) -> float:
    samples = load_prompt_dataset(os.path.join(DATA, "gsm8k_test_20.jsonl"), prompt_key="question",
                                  answer_format="gsm8k")
    forms = ["<think>work</think> so \\boxed{{{a}}}", "\\boxed{{\\frac{{{b}}}{{2}}}}", "\\boxed{{{c}}}"]
    items = [(forms[i % 3].format(a=s.label, b=2 * int(s.label), c=int(s.label) + 1), s.label)
             for i, s in zip(range(n), samples * (n // len(samples) + 1))]
    pool = MathVerifierPool(workers)
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda it: pool.score(*it), items[:workers * 2]))  # start the workers
        start = time.perf_counter()
        list(ex.map(lambda it: pool.score(*it), items))
        elapsed = time.perf_counter() - start
    pool.close()
    return n / elapsed


def bench_humaneval(workers: int) -> tuple[float, float]:
    with open(os.path.join(DATA, "humaneval_0_99.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    cases = sum(len(humaneval_cases(r["test"])) for r in rows)
    responses = [f"```python\n{r['prompt']}{r['canonical_solution']}\n```" for r in rows]
    with SandboxPool(workers) as pool, ThreadPoolExecutor(workers) as ex:
        start = time.perf_counter()
        scores = list(ex.map(lambda rt: code_reward(rt[0], rt[1], pool=pool),
                             zip(responses, [code_tests(r) for r in rows])))
        elapsed = time.perf_counter() - start
    assert scores == [1.0] * len(rows), "a canonical solution failed"
    return cases / elapsed, len(rows) / elapsed


def bench_stdio(workers: int, n: int) -> float:
    tests = {"inputs": [f"{i} {i + 1}" for i in range(n)], "outputs": [str(2 * i + 1) for i in range(n)]}
    with SandboxPool(workers) as pool:
        start = time.perf_counter()
        score = code_reward("```python\na, b = map(int, input().split())\nprint(a + b)\n```", tests, pool=pool)
        elapsed = time.perf_counter() - start
    assert score == 1.0
    return n / elapsed


def sandbox_latency(n: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(n):
        run_python(SandboxJob({"main.py": "pass"}, "main.py"))
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--math-n", type=int, default=400, help="math rewards per measurement")
    p.add_argument("--stdio-n", type=int, default=100, help="stdin/stdout cases per measurement")
    args = p.parse_args()
    print(f"cpus available: {len(os.sched_getaffinity(0))}; empty sandbox run: "
          f"{sandbox_latency() * 1000:.1f} ms")
    print(f"{'workers':>7} {'math rewards/s':>15} {'HumanEval cases/s':>18} {'problems/s':>11} "
          f"{'stdio cases/s':>14}")
    base = None
    for w in args.workers:
        row = (bench_math(w, args.math_n), *bench_humaneval(w), bench_stdio(w, args.stdio_n))
        base = base or row
        ratio = " ".join(f"x{a / b:.2f}" for a, b in zip(row, base))
        print(f"{w:>7} {row[0]:>15.1f} {row[1]:>18.1f} {row[2]:>11.2f} {row[3]:>14.1f}   ({ratio} vs {args.workers[0]})")


if __name__ == "__main__":
    main()
