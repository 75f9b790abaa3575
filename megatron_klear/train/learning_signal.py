"""A run that cannot learn says so (issue 56).

A GPPO step learns only from groups whose responses got different rewards; when every group
of a step shares one reward (all failed, or all solved) dynamic sampling drops them all and
the step is skipped (``train/skipped_step``, ``rollout/zero_adv_frac`` 1.0). A run can go on
so for hours and show only a flat reward curve. :class:`LearningSignalMonitor` watches the
steps: every ``WARN_EVERY`` consecutive skipped steps it warns once, naming the case and what
helps; after ``--max-skipped-steps`` consecutive skipped steps it stops the run with
:class:`NoLearningSignal` (one line, non-zero exit).
"""

from __future__ import annotations

import sys
from typing import Callable

from megatron_klear.cli import RunHalted

WARN_EVERY = 5  # K: one warning per this many consecutive skipped steps


class NoLearningSignal(RunHalted):
    """``--max-skipped-steps`` consecutive steps had nothing to train on."""


def no_signal_case(accuracies: list[float], zero_adv_fracs: list[float]) -> str:
    """Which case skipped steps are in, from their ``rollout/accuracy`` and
    ``rollout/zero_adv_frac``, and what helps."""
    if all(a <= 0.0 for a in accuracies):
        return ("every response failed (each group's rewards all 0): the policy cannot solve "
                "these prompts yet; what helps: more or better SFT, easier or pass@k-filtered "
                "prompts, a denser reward (partial credit), more samples per prompt "
                "(--n-samples-per-prompt)")
    if all(a >= 1.0 for a in accuracies):
        return ("every response succeeded (each group's rewards all 1): the prompts are too "
                "easy for the policy; what helps: harder or pass@k-filtered prompts (drop the "
                "ones it always solves)")
    if all(f >= 1.0 for f in zero_adv_fracs):
        return ("each group's responses shared one reward (some groups all 1, the others all "
                "0); what helps: more samples per prompt (--n-samples-per-prompt), "
                "pass@k-filtered prompts of middle difficulty, a denser reward")
    return ("too few groups had a reward spread to fill one mini-batch; what helps: more "
            "samples per prompt (--n-samples-per-prompt), more refill rounds "
            "(--max-sampling-rounds), pass@k-filtered prompts, a denser reward")


class LearningSignalMonitor:
    """Counts consecutive skipped steps (:meth:`observe` after each step, :meth:`check`
    before the next); ``say`` prints the warnings (rank 0: stderr; other ranks: nothing)."""

    def __init__(self, max_skipped: int, say: Callable[[str], None] | None = None,
                 every: int = WARN_EVERY) -> None:
        self.max_skipped, self.every = max_skipped, every
        self.say = say if say is not None else (lambda msg: print(msg, file=sys.stderr))
        self.accuracies: list[float] = []
        self.zero_adv_fracs: list[float] = []

    def observe(self, step: int, metrics: dict) -> str | None:
        """Record step ``step``'s metrics (1-based); returns the warning it printed, if any."""
        if not metrics.get("train/skipped_step"):
            self.accuracies, self.zero_adv_fracs = [], []
            return None
        self.accuracies.append(float(metrics.get("rollout/accuracy", 0.0)))
        self.zero_adv_fracs.append(float(metrics.get("rollout/zero_adv_frac", 1.0)))
        if len(self.accuracies) % self.every:
            return None
        k = self.every
        msg = (f"[rl] warning: steps {step - k + 1}-{step} trained nothing: "
               f"{no_signal_case(self.accuracies[-k:], self.zero_adv_fracs[-k:])} "
               f"({len(self.accuracies)} steps in a row skipped; the run stops at "
               f"--max-skipped-steps {self.max_skipped})")
        self.say(msg)
        return msg

    def check(self) -> None:
        """Raise :class:`NoLearningSignal` once ``max_skipped`` steps in a row were skipped."""
        n = len(self.accuracies)
        if n >= self.max_skipped:
            raise NoLearningSignal(
                f"stopped: the last {n} steps trained nothing (--max-skipped-steps "
                f"{self.max_skipped}): {no_signal_case(self.accuracies, self.zero_adv_fracs)}")
