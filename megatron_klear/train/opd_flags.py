"""On-policy distillation's flags (issue 54; slime's names): a teacher scores the student's
own samples, and its per-token log-probs become a dense advantage (algo/opd.py).

``--use-opd`` turns it on, ``--opd-kl-coef`` is lambda. ``--opd-type sglang``: a served
teacher (SGLang, or an embedded server) at ``--opd-teacher-urls``, scored by
rollout/orchestration/teacher.py. ``--opd-type megatron`` (a checkpoint teacher at
``--opd-teacher-load``) is refused as not implemented yet. Pure distillation is ``--reward
none`` (every reward 0, so the group advantage is 0 and only the teacher's term trains). Up
front, in the dry run as in a real run: each teacher URL answers, and serves a model whose
tokenizer is the student's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_klear.config import ConfigError, Section, opt

__all__ = ["OPDFlags", "check_teacher_tokenizer"]


@dataclass
class OPDFlags(Section):
    """On-policy distillation: a teacher's log-prob of each sampled token (docs/opd.md)."""

    title = "on-policy distillation"
    use_opd: bool = opt(False, "on-policy distillation: each trained token's advantage loses "
                        "--opd-kl-coef x (student - teacher log-prob); with --reward none, "
                        "pure distillation (docs/opd.md)")
    opd_type: str = opt("sglang", "the teacher: sglang = served (SGLang or an embedded server "
                        "at --opd-teacher-urls), megatron = a checkpoint (--opd-teacher-load; "
                        "not implemented yet)", choices=("sglang", "megatron"))
    opd_kl_coef: float = opt(1.0, "lambda: the weight of the per-token reverse KL in the "
                             "advantage")
    opd_teacher_urls: list[str] | None = opt(None, "with --opd-type sglang: the teacher "
                                             "servers' base URLs (its tokenizer must be the "
                                             "student's)")
    opd_teacher_load: str | None = opt(None, "with --opd-type megatron: the teacher's "
                                       "checkpoint dir")
    opd_teacher_temperature: float = opt(1.0, "temperature of the teacher's log-probs (a "
                                         "served teacher scores at 1 only: SGLang's input "
                                         "log-probs ignore temperature)")

    def validate_section(self) -> None:
        """The flags alone: they need --use-opd, the teacher of their --opd-type, lambda > 0,
        a temperature the teacher can score at, and a per-token loss."""
        if not self.use_opd:
            changed = [f for f, default in (("opd_type", "sglang"), ("opd_kl_coef", 1.0),
                                            ("opd_teacher_urls", None),
                                            ("opd_teacher_load", None),
                                            ("opd_teacher_temperature", 1.0))
                       if getattr(self, f) != default]
            if changed:
                raise ConfigError(f"--{changed[0].replace('_', '-')} applies with --use-opd: "
                                  "add --use-opd or drop it")
            if getattr(self, "reward", None) == "none":
                raise ConfigError("--reward none scores every response 0 (pure distillation): "
                                  "add --use-opd with a teacher, or choose a reward")
            return
        if not self.opd_kl_coef > 0:
            raise ConfigError(f"--opd-kl-coef must be > 0, got {self.opd_kl_coef}")
        if not self.opd_teacher_temperature > 0:
            raise ConfigError(f"--opd-teacher-temperature must be > 0, got "
                              f"{self.opd_teacher_temperature}")
        if self.opd_type == "sglang":
            if not self.opd_teacher_urls:
                raise ConfigError("--use-opd --opd-type sglang needs --opd-teacher-urls URL... "
                                  "(the served teacher)")
            if self.opd_teacher_load:
                raise ConfigError("--opd-teacher-load is the checkpoint of --opd-type megatron; "
                                  "drop it (the served teacher is --opd-teacher-urls)")
            if self.opd_teacher_temperature != 1.0:
                raise ConfigError(f"--opd-teacher-temperature {self.opd_teacher_temperature}: a "
                                  "served teacher scores at 1 only (SGLang computes input "
                                  "log-probs from the unscaled logits); drop the flag")
        else:
            if not self.opd_teacher_load:
                raise ConfigError("--use-opd --opd-type megatron needs --opd-teacher-load DIR "
                                  "(the teacher's checkpoint)")
            if self.opd_teacher_urls:
                raise ConfigError("--opd-teacher-urls is the served teacher of --opd-type "
                                  "sglang; drop it with --opd-type megatron")
        if getattr(self, "loss_type", None) == "gspo":
            raise ConfigError("--use-opd gives each token its own advantage; --loss-type gspo "
                              "takes one per response: use another --loss-type")

    def check_inputs_section(self, model: Any) -> None:
        """The teacher exists: its checkpoint dir (megatron, then refused as not built yet),
        or each URL answers /model_info and serves the student's tokenizer."""
        if not self.use_opd:
            return
        if self.opd_type == "megatron":
            if not Path(self.opd_teacher_load).is_dir():
                raise ConfigError(f"--opd-teacher-load {self.opd_teacher_load}: no such "
                                  "directory (the teacher's checkpoint)")
            raise ConfigError("--opd-type megatron (a checkpoint teacher) is not implemented "
                              "yet: serve the teacher (SGLang, or python -m "
                              "megatron_klear.rollout.engine) and use --opd-type sglang "
                              "--opd-teacher-urls URL")
        from megatron_klear.rollout.orchestration.client import RolloutClient, RolloutError

        for url in self.opd_teacher_urls:
            try:
                info = RolloutClient([url], request_timeout_s=10).get_all("/model_info")
            except (RolloutError, OSError) as e:
                raise ConfigError(f"--opd-teacher-urls {url} does not answer ({e}); start the "
                                  "teacher server or fix the URL") from None
            path = next(iter(info.values())) or {}
            check_teacher_tokenizer(url, path.get("tokenizer_path") or path.get("model_path"),
                                    self.hf_checkpoint)


def check_teacher_tokenizer(url: str, teacher_dir: str | None, student_dir: str) -> None:
    """ConfigError naming both unless the teacher's tokenizer (its server's /model_info
    ``tokenizer_path``, a directory on this machine) has the student's vocabulary, token for
    token: distillation compares the two models' log-probs of the same token ids."""
    from transformers import AutoTokenizer

    if not teacher_dir or not Path(teacher_dir).is_dir():
        raise ConfigError(f"--opd-teacher-urls {url}: its tokenizer_path {teacher_dir!r} "
                          f"(GET /model_info) is not a directory on this machine, so its "
                          f"tokenizer cannot be checked against --hf-checkpoint {student_dir}; "
                          "serve the teacher from a path this machine also sees")
    teacher = AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    student = AutoTokenizer.from_pretrained(student_dir).get_vocab()
    if teacher != student:
        differ = len(set(teacher.items()) ^ set(student.items()))
        raise ConfigError(f"--opd-teacher-urls {url} serves {teacher_dir}, whose tokenizer "
                          f"({len(teacher)} tokens) is not the student's --hf-checkpoint "
                          f"{student_dir} ({len(student)} tokens; {differ} entries differ): "
                          "the teacher must share the student's tokenizer")
