"""Klear-Reasoner's released rewards: +1 / -1 with format penalties (``math_klear``,
``code_klear``).

As Kwai-Klear/KlearReasoner scores long-CoT responses (verl/utils/reward_score/math_dapo.py,
code_r1_compute.py and reward_config.py at 3422f6d), checked in this order:

* no ``</think>``: -0.5 (the thinking never closed, e.g. truncated);
* else no ``<think>``: -2;
* math: the text after the last ``</think>``, parsed by math-verify (5 s timeouts); +1 when its
  extracted answer string equals the reference or math-verify finds it equivalent to
  ``\\boxed{reference}``, else -1;
* code: the last python block after the last ``</think>`` (none: -1) runs on up to 16 of the
  tests, sampled with a seed fixed by the tests (every sample of a prompt meets the same
  subset; the official code draws from the global ``random`` per response); the reward is the
  mean of +1 per passed and -1 per failed test.

Both have the maximum score 1 (``max_score``): only fully correct responses are the SFT term's
positives. math-verify runs in the verifier worker processes of :mod:`.math` (SIGALRM timeouts
need a main thread), whose ``klear`` mode (:func:`~megatron_klear.rewards.math.verify_klear`)
is the check of math_dapo.py.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from megatron_klear.rewards.math import gold_text, shared_verifier
from megatron_klear.rewards.text import THINK_END

CORRECT, INCORRECT = 1.0, -1.0
NO_THINK_END, NO_THINK_START = -0.5, -2.0   # reward_config.py wo_eos_think / wo_bos_think
NO_CODE = -1.0                               # format_error_score
MAX_CODE_TESTS = 16
WALL_TIMEOUT_S = 15.0   # parse (5 s) + verify (5 s) + worker start-up


def format_penalty(response: Any) -> float | None:
    """-0.5 without ``</think>``, else -2 without ``<think>``, else None (well formed)."""
    if not isinstance(response, str) or THINK_END not in response:
        return NO_THINK_END
    if "<think>" not in response:
        return NO_THINK_START
    return None


def math_klear(response: str, answer: Any, *, timeout_s: float = WALL_TIMEOUT_S) -> float:
    """Klear's math reward: +1 / -1, -0.5 without ``</think>``, -2 without ``<think>``."""
    penalty = format_penalty(response)
    if penalty is not None:
        return penalty
    try:
        gold = [gold_text(a) for a in answer] if isinstance(answer, list) else [gold_text(answer)]
    except TypeError:
        return INCORRECT
    final = response.rsplit(THINK_END, 1)[1]
    verdict = shared_verifier().score(final, gold, timeout_s, mode="klear", failed=0.0)
    return CORRECT if verdict == 1.0 else INCORRECT


math_klear.max_score = CORRECT


def sample_tests(tests: dict, count: int, limit: int = MAX_CODE_TESTS) -> list[int]:
    """Indices of up to ``limit`` of ``count`` test cases, seeded by the tests themselves."""
    if count <= limit:
        return list(range(count))
    seed = hashlib.sha256(json.dumps(tests, sort_keys=True, default=str).encode()).digest()
    return sorted(random.Random(seed).sample(range(count), limit))


def code_klear(response: str, tests: dict, **kw: Any) -> float:
    """Klear's code reward: mean of +1 / -1 over up to 16 sampled tests; -1 without a python
    block after ``</think>``, -0.5 without ``</think>``, -2 without ``<think>``."""
    from megatron_klear.rewards.code import case_verdicts, humaneval_cases, test_format
    from megatron_klear.rewards.text import last_python_block

    penalty = format_penalty(response)
    if penalty is not None:
        return penalty
    if not last_python_block(response):
        return NO_CODE
    kind = test_format(tests)
    if kind == "humaneval":   # cases live inside one check(): run all, keep the sample
        verdicts = case_verdicts(response, tests, **kw)
        verdicts = [verdicts[i] for i in sample_tests(tests, len(humaneval_cases(tests["test"])))]
    else:
        keep = sample_tests(tests, len(tests["inputs"]))
        subset = dict(tests, inputs=[tests["inputs"][i] for i in keep],
                      outputs=[tests["outputs"][i] for i in keep])
        verdicts = case_verdicts(response, subset, **kw)
    if not verdicts:
        return INCORRECT
    return sum(CORRECT if ok else INCORRECT for ok in verdicts) / len(verdicts)


code_klear.max_score = CORRECT
