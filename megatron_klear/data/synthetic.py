"""Generated chain-of-thought arithmetic for the CPU quickstart (no downloads).

Problems are ``a + b * c`` with ``a`` a whole hundred (100-900) and ``b``, ``c`` one digit;
the response reasons in two steps and ends with ``\\boxed{answer}``, so the real math reward
(math-verify on ``\\boxed{}``) scores it.

Like distilled long-CoT data, the SFT demonstrations are noisy: a fraction ends with a wrong
boxed answer after correct reasoning. SFT imitates that noise; RL with the verified reward
is what removes it, which makes the quickstart's RL gain visible in minutes on a CPU.

Why hundreds (issue 32): with a one-digit ``a`` the tiny model had to learn ~300 sums such as
6+14=20 and learnt them per question; RL then raised the reward on the RL prompts (0.32 ->
0.58) by memorising those questions, while on held-out questions the reasoning itself was
wrong 7 times in 10 and avg@4 moved within noise (0.246 -> 0.270), although RL had taught
what generalises, copying the reasoning's result into the box (0.49 -> 0.80 of held-out
samples). Adding a hundred is writing its digit before the product, a step the model learns
for every question, so after SFT the held-out reasoning is right in 86% of samples and
RL's lesson shows there (box equals reasoning 0.51 -> 0.89, avg@4 0.52 -> 0.91, seed 1).
Held-out questions are new (a, b, c) triples; their facts (b*c, the hundred) are not new,
as in any arithmetic benchmark.

The ``--tools`` quickstart's task (:func:`write_tool_arithmetic_data`, issue 40) is ``a*b``
with two-digit ``a``, ``b``: 8,100 products the tiny model cannot learn to compute, which the
python tool computes; demonstrations call it, guess, call it wrongly or copy its output
wrongly (:data:`TOOL_USES`), and RL on the verified final answer keeps what works.

The toy code task of the paper study (:func:`write_code_function_data`, issue 53): infer a
linear function from two examples and print it for a stdin input, checked on three tests in
the code sandbox; flawed demonstrations pass some tests, so partial credit exists.
"""

from __future__ import annotations

import random
from pathlib import Path

from megatron_klear.data.records_io import write_records
from megatron_klear.rewards.sandbox import PYTHON_SCHEMA


def arithmetic_problem(rng: random.Random, wrong_answer_rate: float = 0.0
                       ) -> tuple[str, str, int]:
    """(question, chain-of-thought response, answer); the boxed answer is off by 1-3 with
    probability ``wrong_answer_rate``."""
    a, b, c = 100 * rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    answer = a + b * c
    boxed = answer + rng.choice((-3, -2, -1, 1, 2, 3)) if rng.random() < wrong_answer_rate \
        else answer
    question = f"What is {a}+{b}*{c}?"
    response = f"<think>{b}*{c}={b * c}, {a}+{b * c}={answer}.</think> \\boxed{{{boxed}}}"
    return question, response, answer


def write_arithmetic_data(out_dir: str | Path, *, seed: int = 0, n_sft: int = 2000,
                          n_rl: int = 1000, n_eval: int = 256,
                          wrong_answer_rate: float = 0.4) -> dict[str, Path]:
    """sft.jsonl (prompt/response), rl.jsonl and eval.jsonl (prompt/answer) in ``out_dir``.

    The eval problems are disjoint from the RL and SFT prompts.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pool = {}
    while len(pool) < 729:  # every (a, b, c) triple
        q, r, a = arithmetic_problem(rng)
        pool[q] = (r, a)
    questions = sorted(pool)
    rng.shuffle(questions)
    eval_q, train_q = questions[:n_eval], questions[n_eval:]
    train_q_set = set(train_q)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "rl", "eval")}
    sft = []
    for _ in range(n_sft):
        q, r, _ = arithmetic_problem(rng, wrong_answer_rate)
        while q not in train_q_set:
            q, r, _ = arithmetic_problem(rng, wrong_answer_rate)
        sft.append({"prompt": q, "response": r})
    write_records(paths["sft"], sft)
    write_records(paths["rl"], ({"prompt": q, "answer": str(pool[q][1])} for q in
                                (rng.choice(train_q) for _ in range(n_rl))))
    write_records(paths["eval"], ({"prompt": q, "answer": str(pool[q][1])} for q in eval_q))
    return paths


# --------------------------------------------------------------- the --tools quickstart task
# How SFT demonstrations of multiplication use the python tool (issue 40), with their shares:
# only "tool" ends with the right answer; the rest is the noise RL has to remove.
TOOL_USES = (("tool", 0.5),         # print(a*b), then the box holds what it printed
             ("guess", 0.2),        # no call: a boxed guess (the tiny model cannot multiply)
             ("wrong_code", 0.1),   # a call with a wrong expression, its output boxed
             ("miscopy", 0.2))      # the right call, its output boxed with a digit changed


def _call(code: str) -> dict:
    return {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}


def _miscopy(rng: random.Random, number: int) -> int:
    digits = list(str(number))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0")])
    return int("".join(digits))


def tool_question(a: int, b: int) -> str:
    """The question of ``a*b``: the expression in parentheses, as the call's ``print(...)``
    writes it, so a tiny model copies it from the one '(' before (an induction step)."""
    return f"What is ({a}*{b})?"


def tool_trajectory(rng: random.Random, a: int, b: int, use: str) -> list[dict]:
    """The messages of one demonstration for ``a*b`` in the style ``use`` (:data:`TOOL_USES`):
    a python call with no content, the tool's output (``print``'s, newline included), the box."""
    question = {"role": "user", "content": tool_question(a, b)}
    if use == "guess":
        return [question, {"role": "assistant",
                           "content": f"\\boxed{{{a * b + rng.choice((-1, 1)) * rng.randint(1, 300)}}}"}]
    x, op, y = a, "*", b
    if use == "wrong_code":
        x, op, y = rng.choice(((a, "+", b), (a, "*", _miscopy(rng, b)), (_miscopy(rng, a), "*", b)))
    code, out = f"print({x}{op}{y})", x + y if op == "+" else x * y
    boxed = _miscopy(rng, out) if use == "miscopy" else out
    return [question, {"role": "assistant", "content": "", "tool_calls": [_call(code)]},
            {"role": "tool", "content": f"{out}\n"},
            {"role": "assistant", "content": f"\\boxed{{{boxed}}}"}]


def write_tool_arithmetic_data(out_dir: str | Path, *, seed: int = 0, n_sft: int = 2000,
                               n_rl: int = 1000, n_eval: int = 128) -> dict[str, Path]:
    """The ``--tools`` quickstart's data: ``a*b`` with two-digit ``a``, ``b``, which the tiny
    model cannot compute but the python tool can. sft.jsonl holds ``messages`` trajectories
    with the python tool's schema in ``tools`` (noisy tool use, :data:`TOOL_USES`); rl.jsonl and
    eval.jsonl prompt/answer, the eval pairs disjoint from the SFT and RL ones."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    eval_pairs, train = pairs[:n_eval], pairs[n_eval:]
    uses, weights = zip(*TOOL_USES)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "rl", "eval")}
    write_records(paths["sft"], ({"tools": [PYTHON_SCHEMA], "messages": tool_trajectory(
        rng, *rng.choice(train), rng.choices(uses, weights)[0])} for _ in range(n_sft)))
    for name, chosen in (("rl", (rng.choice(train) for _ in range(n_rl))), ("eval", eval_pairs)):
        write_records(paths[name], ({"prompt": tool_question(a, b), "answer": str(a * b)}
                                    for a, b in chosen))
    return paths


# --------------------------------------------------------------- the toy code task (issue 53)
# A linear function f(x) = a*x + b shown by two examples, f(0) = b and f(10) = 10a + b (so its
# digits spell a then b: a copying step the tiny model learns for every function), and a
# program that reads x from stdin and prints f(x), checked on CODE_TEST_INPUTS. The flawed
# programs of the SFT data pass some of the tests (:data:`CODE_FLAWS`), so the soft reward (the
# pass rate) and the hard one (all pass) differ on them: section 5.2.3's partial credit.
CODE_TEST_INPUTS = (0, 1, 2)
CODE_FLAWS = (("slope", 0.4),    # a miscopied: right at x=0 only (1 of 3 tests)
              ("square", 0.4),   # a*x*x+b: right at x=0 and x=1 (2 of 3)
              ("offset", 0.2))   # b miscopied: no test passes


def code_program(a: int, b: int, flaw: str | None = None) -> str:
    """The program printing ``a*x+b`` for the ``x`` it reads, or its ``flaw`` (:data:`CODE_FLAWS`)."""
    expr = {None: f"{a}*x+{b}", "slope": f"{a + 1}*x+{b}", "square": f"{a}*x*x+{b}",
            "offset": f"{a}*x+{b + 1}"}[flaw]
    return f"x=int(input())\nprint({expr})"


def code_function_problem(a: int, b: int, flaw: str | None = None) -> dict:
    """One problem of the toy code task: the prompt, an SFT response (the program of
    :func:`code_program` after the reasoning, in a python fence) and the stdin/stdout tests."""
    prompt = f"f(0)={b}, f(10)={10 * a + b}. Read x, print f(x)."
    response = f"<think>f(x)={a}*x+{b}</think>\n```python\n{code_program(a, b, flaw)}\n```"
    return {"prompt": prompt, "response": response,
            "inputs": [f"{x}\n" for x in CODE_TEST_INPUTS],
            "outputs": [f"{a * x + b}\n" for x in CODE_TEST_INPUTS]}


def write_code_function_data(out_dir: str | Path, *, seed: int = 0, n_sft: int = 2000,
                             n_rl: int = 1000, n_eval: int = 48, flaw_rate: float = 0.4
                             ) -> dict[str, Path]:
    """The toy code task's sft.jsonl (prompt/response; a ``flaw_rate`` share of the programs
    flawed), rl.jsonl and eval.jsonl (prompt with inputs/outputs tests, scored by the code
    rewards in the sandbox). Functions are ``a`` in 1..49, ``b`` in 0..9; the eval functions
    are never in the SFT or RL data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(1, 50) for b in range(10)]
    rng.shuffle(pairs)
    eval_pairs, train = pairs[:n_eval], pairs[n_eval:]
    flaws, weights = zip(*CODE_FLAWS)
    paths = {name: out / f"{name}.jsonl" for name in ("sft", "rl", "eval")}
    sft = []
    for _ in range(n_sft):
        flaw = rng.choices(flaws, weights)[0] if rng.random() < flaw_rate else None
        p = code_function_problem(*rng.choice(train), flaw)
        sft.append({"prompt": p["prompt"], "response": p["response"]})
    write_records(paths["sft"], sft)
    for name, chosen in (("rl", (rng.choice(train) for _ in range(n_rl))), ("eval", eval_pairs)):
        write_records(paths[name], ({k: v for k, v in code_function_problem(a, b).items()
                                     if k != "response"} for a, b in chosen))
    return paths
