"""On-policy distillation's advantage (issue 54): a teacher's log-prob of each sampled token.

For every trained token t of a student's own rollout,

    A_t = A_task - coef * (log pi_student(y_t) - log pi_teacher(y_t)),

the GPPO group advantage plus the negated per-token reverse KL, whose expectation under the
student's samples is KL(student || teacher) (the sampled-token estimate Thinking Machines and
slime use). ``coef`` is ``--opd-kl-coef``. The student's log-prob is the one the policy loss
already holds (old log-probs, or the engine's under a rollout correction); the teacher's comes
from the served teacher (rollout/orchestration/teacher.py). Masked tokens (multi-turn tool
responses, dropped samples) get no teacher term.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["opd_advantages"]


def opd_advantages(task: Tensor, student: Tensor, teacher: Tensor, mask: Tensor,
                   coef: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantages ``task - coef * (student - teacher)`` where ``mask`` is set
    (``task`` elsewhere), and token sums of the step's OPD metrics: ``opd_reverse_kl``
    (student - teacher log-prob), ``opd_teacher_logprob``, and the absolute advantage from the
    teacher (``opd_teacher_adv_abs``) and from the task (``opd_task_adv_abs``), whose ratio
    is the teacher's share of the advantage. All tensors share the labels' shape."""
    on = mask > 0
    log_ratio = torch.where(on, student.detach() - teacher, 0.0)
    teacher_part = -coef * log_ratio
    stats = {"opd_reverse_kl": log_ratio.sum(),
             "opd_teacher_logprob": torch.where(on, teacher, 0.0).sum(),
             "opd_teacher_adv_abs": teacher_part.abs().sum(),
             "opd_task_adv_abs": torch.where(on, task, 0.0).abs().sum()}
    return task + teacher_part, stats
