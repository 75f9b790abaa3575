"""A run that cannot learn says so (issue 56, train/learning_signal.py): every WARN_EVERY
skipped steps in a row one warning naming the case (all 0, all 1, groups that each share one
reward) and what helps; --max-skipped-steps in a row stop the run with one line. The real
klear-rl run that stops is tests/multiprocess/test_rl.py::test_a_run_that_cannot_learn_warns_and_stops."""

import pytest

from megatron_klear.config import ConfigError, parse_config
from megatron_klear.train.learning_signal import WARN_EVERY, LearningSignalMonitor, \
    NoLearningSignal
from megatron_klear.train.rl_config import RLConfig


def _skipped(accuracy: float, zero_adv_frac: float = 1.0) -> dict:
    return {"train/skipped_step": 1.0, "rollout/accuracy": accuracy,
            "rollout/zero_adv_frac": zero_adv_frac}


TRAINED = {"train/loss": 0.1, "rollout/accuracy": 0.5, "rollout/zero_adv_frac": 0.5}


@pytest.mark.parametrize("accuracy, zero_adv, case, helps", [
    (0.0, 1.0, "every response failed (each group's rewards all 0)", "more or better SFT"),
    (1.0, 1.0, "every response succeeded (each group's rewards all 1)", "harder or pass@k"),
    (0.5, 1.0, "each group's responses shared one reward", "more samples per prompt"),
    (0.5, 0.75, "too few groups had a reward spread", "--max-sampling-rounds"),
])
def test_one_warning_per_k_skipped_steps_naming_the_case(accuracy, zero_adv, case, helps):
    said = []
    mon = LearningSignalMonitor(100, said.append)
    for step in range(1, 3 * WARN_EVERY + 1):
        mon.check()
        mon.observe(step, _skipped(accuracy, zero_adv))
    assert len(said) == 3  # once per K steps, not every step
    assert said[0].startswith(f"[rl] warning: steps 1-{WARN_EVERY} trained nothing: {case}")
    assert helps in said[0] and f"{3 * WARN_EVERY} steps in a row" in said[2]
    if accuracy == 0.0:
        assert all(h in said[0] for h in ("easier or pass@k-filtered prompts", "a denser reward",
                                          "more samples per prompt"))


def test_a_trained_step_resets_the_count_and_the_stop_needs_n_in_a_row():
    said = []
    mon = LearningSignalMonitor(WARN_EVERY + 1, said.append)
    for step in range(1, WARN_EVERY):            # K - 1 skipped, then one that trains
        mon.observe(step, _skipped(0.0))
    mon.observe(WARN_EVERY, TRAINED)
    for step in range(WARN_EVERY + 1, 2 * WARN_EVERY + 1):   # K skipped in a row: one warning
        mon.check()
        mon.observe(step, _skipped(0.0))
    assert len(said) == 1 and f"steps {WARN_EVERY + 1}-{2 * WARN_EVERY}" in said[0]
    mon.check()                                  # K in a row < K + 1: the run goes on
    mon.observe(2 * WARN_EVERY + 1, _skipped(0.0))
    with pytest.raises(NoLearningSignal, match=rf"^stopped: the last {WARN_EVERY + 1} steps "
                                               rf"trained nothing \(--max-skipped-steps "
                                               rf"{WARN_EVERY + 1}\): every response failed"):
        mon.check()


def test_max_skipped_steps_flag():
    """A generous finite default; below 1 is refused by name."""
    cfg = parse_config(RLConfig, ["--hf-checkpoint", "x", "--prompt-data", "y"])
    assert 4 * WARN_EVERY <= cfg.max_skipped_steps < 1000
    with pytest.raises(ConfigError, match="--max-skipped-steps must be >= 1"):
        parse_config(RLConfig, ["--hf-checkpoint", "x", "--prompt-data", "y",
                                "--max-skipped-steps", "0"])
