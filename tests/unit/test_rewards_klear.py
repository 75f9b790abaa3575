"""Klear's +-1 rewards with format penalties (rewards/klear.py) against hand tables, through
the reward registry (real math-verify worker processes, real sandboxed code runs)."""

import pytest

from megatron_klear.rewards import get_reward, reward_max_score, score_batch
from megatron_klear.rewards.klear import sample_tests

T = "<think>working it out</think>"

MATH_TABLE = [   # (response, answer, reward): penalties first, in Klear's order
    (f"{T} so the answer is \\boxed{{42}}", "42", 1.0),
    (f"{T} so the answer is \\boxed{{41}}", "42", -1.0),
    (f"{T} \\boxed{{\\frac{{1}}{{2}}}}", "0.5", 1.0),           # math-verify equivalence
    (f"{T} $x = 3$ and then \\boxed{{-7}}", "-7", 1.0),
    ("<think>never closed ... \\boxed{42}", "42", -0.5),         # no </think>: -0.5
    ("\\boxed{42} and no thinking at all", "42", -0.5),           # neither: -0.5 comes first
    ("the answer</think> \\boxed{42}", "42", -2.0),               # </think> without <think>
    (f"\\boxed{{42}} {T} no answer after thinking", "42", -1.0),  # only after </think> counts
    (f"{T} nothing to parse here", "42", -1.0),
    (f"{T} \\boxed{{7}}", ["6", "7"], 1.0),                       # a list of references
]


def test_math_klear_hand_table():
    fn = get_reward("math_klear")
    got = score_batch("math_klear", [r for r, _, _ in MATH_TABLE], [a for _, a, _ in MATH_TABLE])
    assert got == [w for _, _, w in MATH_TABLE]
    assert reward_max_score("math_klear") == 1.0 and fn.max_score == 1.0
    assert reward_max_score("math") == 1.0   # rewards without the attribute: 1


def _code(body: str, think: str = T) -> str:
    return f"{think}\n```python\n{body}\n```\n"


DOUBLE = "print(int(input()) * 2)"
STDIO = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["2\n", "4\n", "6\n", "9\n"]}

CODE_TABLE = [   # (response, reward)
    (_code(DOUBLE), (3 - 1) / 4),                    # 3 of 4 pass: mean of +1 +1 +1 -1
    (_code("print(0)"), -1.0),                       # every test fails
    (f"{T} I would just print the double.", -1.0),   # no code block: -1
    (_code(DOUBLE, think="<think>unfinished"), -0.5),
    (_code(DOUBLE, think="done</think>"), -2.0),
    (_code(DOUBLE, think=""), -0.5),                 # neither tag: -0.5 is checked first
    ("<think>```python\n" + DOUBLE + "\n```</think> see above", -1.0),  # code only in thinking
]


def test_code_klear_hand_table():
    got = score_batch("code_klear", [r for r, _ in CODE_TABLE], [STDIO] * len(CODE_TABLE))
    assert got == [w for _, w in CODE_TABLE]


def test_code_klear_samples_16_tests_with_a_fixed_seed():
    """40 tests: the program passes the first 20 only, so the reward reveals how many of the
    16 sampled tests come from each half; the sample is the same on every call."""
    tests = {"inputs": [f"{i}\n" for i in range(40)],
             "outputs": [f"{2 * i}\n" if i < 20 else "x\n" for i in range(40)]}
    keep = sample_tests(tests, 40)
    assert len(keep) == 16 == len(set(keep)) and keep == sample_tests(tests, 40)
    passed = sum(i < 20 for i in keep)
    assert 0 < passed < 16   # the seed draws from both halves
    got = get_reward("code_klear")(_code(DOUBLE), tests)
    assert got == pytest.approx((passed - (16 - passed)) / 16)
    assert sample_tests(tests, 10) == list(range(10))


def test_sft_positives_are_the_rewards_maximum_whatever_the_scale():
    """rl.py's positive flag: reward == the reward's max_score (1 for +-1 rewards; a custom
    reward scored out of 5 marks only its 5s), not 'reward >= 1'."""
    from megatron_klear.data.microbatches import sample_fields
    from megatron_klear.samples import RolloutBatch

    b = RolloutBatch(group_size=4, max_score=5.0, prompt_ids=[[1, 2]] * 4,
                     response_ids=[[3, 4]] * 4, rollout_logprobs=[[0.0, 0.0]] * 4,
                     rewards=[5.0, 1.0, 4.0, -2.0], advantages=[0.0] * 4)
    assert [sample_fields(b, i)[1]["positive"][-1] for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
    b.max_score = 1.0
    b.rewards = [1.0, -1.0, -0.5, -2.0]
    assert [sample_fields(b, i)[1]["positive"][-1] for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
