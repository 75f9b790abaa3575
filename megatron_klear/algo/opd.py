"""On-policy distillation's signal (issue 54): a teacher's log-probs on the student's own
rollout, as a per-token advantage (the sampled-token estimate) or a top-k KL loss term.

Sampled token (``--opd-top-k 0``, the default). For every trained token t,

    A_t = A_task - coef * (log pi_student(y_t) - log pi_teacher(y_t)),

the GPPO group advantage plus the negated per-token reverse KL, whose expectation under the
student's samples is KL(student || teacher) (the sampled-token estimate Thinking Machines and
slime use). ``coef`` is ``--opd-kl-coef``. The student's log-prob is the one the policy loss
already holds (old log-probs, or the engine's under a rollout correction); the teacher's comes
from the served teacher (rollout/orchestration/teacher.py). Masked tokens (multi-turn tool
responses, dropped samples) get no teacher term.

Top-k (``--opd-top-k K``). The teacher returns its K most likely tokens S_t at each trained
position t with their log-probs; the advantage stays A_task and the loss adds
``coef x`` (aggregated as the policy loss, over the same mask) the reverse KL of the two
distributions restricted to S_t and renormalised over it:

    KL_t = sum_{v in S_t} q_s(v) (log q_s(v) - log q_t(v)),
    q_s(v) = softmax_{S_t}(z_s / T)(v),   q_t(v) = p_t(v) / sum_{u in S_t} p_t(u),

z_s the student's current logits (differentiable; T the rollout temperature, as the student's
log-probs elsewhere), p_t the teacher's full-vocabulary probabilities. This is NeMo-RL's
``DistillationLossFn`` with ``kl_type: reverse``, ``zero_outside_topk: false`` (student and
teacher both renormalised over the teacher's top-k); it is 0 exactly when the student's
distribution on S_t is proportional to the teacher's.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["opd_advantages", "opd_stats", "topk_reverse_kl"]


def opd_stats(kl: Tensor, task: Tensor, teacher: Tensor, mask: Tensor,
              coef: float) -> dict[str, Tensor]:
    """Token sums of a step's OPD metrics where ``mask`` is set: ``opd_reverse_kl`` (the
    per-token KL estimate ``kl``), ``opd_teacher_logprob`` (the teacher's log-prob of the
    sampled token), and the absolute signal from the teacher (``opd_teacher_adv_abs``, coef x
    |kl|) and from the task (``opd_task_adv_abs``), whose ratio is the teacher's share."""
    on = mask > 0
    kl = torch.where(on, kl.detach(), 0.0)
    return {"opd_reverse_kl": kl.sum(),
            "opd_teacher_logprob": torch.where(on, teacher, 0.0).sum(),
            "opd_teacher_adv_abs": (coef * kl).abs().sum(),
            "opd_task_adv_abs": torch.where(on, task, 0.0).abs().sum()}


def opd_advantages(task: Tensor, student: Tensor, teacher: Tensor, mask: Tensor,
                   coef: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantages ``task - coef * (student - teacher)`` where ``mask`` is set
    (``task`` elsewhere), and the step's OPD metrics (:func:`opd_stats`, the log-ratio as the
    KL estimate). All tensors share the labels' shape."""
    log_ratio = torch.where(mask > 0, student.detach() - teacher, 0.0)
    return task - coef * log_ratio, opd_stats(log_ratio, task, teacher, mask, coef)


def topk_reverse_kl(student_logits: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """Per position, KL(q_s || q_t) over the teacher's top-k ids (module doc): the student's
    logits and the teacher's log-probs of those ids ``[..., k]`` -> ``[...]``, both
    renormalised over the k; differentiable in the student's logits."""
    student = torch.log_softmax(student_logits.float(), dim=-1)
    teacher = torch.log_softmax(teacher_logprobs.float(), dim=-1)
    return (student.exp() * (student - teacher)).sum(-1)
