"""On-policy distillation's flags (issue 54; slime's names): a teacher scores the student's
own samples, and its per-token log-probs become a dense advantage (algo/opd.py).

``--use-opd`` turns it on, ``--opd-kl-coef`` is lambda. ``--opd-type sglang``: a served
teacher (SGLang, or an embedded server) at ``--opd-teacher-urls``, scored by
rollout/orchestration/teacher.py. ``--opd-type megatron``: a checkpoint teacher at
``--opd-teacher-load``, run by the trainer (train/frozen_policy.py). Pure distillation is ``--reward
none`` (every reward 0, so the group advantage is 0 and only the teacher's term trains). Up
front, in the dry run as in a real run: each teacher URL answers, and serves a model whose
tokenizer is the student's; a teacher checkpoint exists, splits at the student's layout and
has the student's vocabulary.

Top-k and several teachers (served teachers only): ``--opd-top-k K`` has the teacher return
its K most likely tokens per response position, and the loss adds lambda x the reverse KL over
them (algo/opd.py) instead of the sampled-token advantage. ``--opd-teacher-urls math=URL
code=URL`` names the teachers (a name may repeat: its URLs are balanced), and
``--opd-teacher-key FIELD`` is the prompt record's field naming each prompt's teacher; every
record's value is checked up front against the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import re
from typing import Any

from megatron_klear.config import ConfigError, Section, opt

__all__ = ["OPDFlags", "check_megatron_teacher", "check_teacher_routes",
           "check_teacher_tokenizer", "parse_teachers", "vocab_difference"]

_TEACHER_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class OPDFlags(Section):
    """On-policy distillation: a teacher's log-prob of each sampled token (docs/opd.md)."""

    title = "on-policy distillation"
    use_opd: bool = opt(False, "on-policy distillation: each trained token's advantage loses "
                        "--opd-kl-coef x (student - teacher log-prob); with --reward none, "
                        "pure distillation (docs/opd.md)")
    opd_type: str = opt("sglang", "the teacher: sglang = served (SGLang or an embedded server "
                        "at --opd-teacher-urls), megatron = a checkpoint run by the trainer "
                        "(--opd-teacher-load)", choices=("sglang", "megatron"))
    opd_kl_coef: float = opt(1.0, "lambda: the weight of the per-token reverse KL in the "
                             "advantage")
    opd_teacher_urls: list[str] | None = opt(None, "with --opd-type sglang: the teacher "
                                             "servers' base URLs (its tokenizer must be the "
                                             "student's)")
    opd_teacher_load: str | None = opt(None, "with --opd-type megatron: the teacher's "
                                       "Megatron checkpoint (or HF dir); any size whose "
                                       "vocabulary is the student's")
    opd_teacher_temperature: float = opt(1.0, "temperature of the teacher's log-probs (a "
                                         "served teacher scores at 1 only: SGLang's input "
                                         "log-probs ignore temperature)")
    # top-k and several teachers (served teachers; docs/opd.md)
    opd_top_k: int = opt(0, "K > 0: the served teacher returns its K most likely tokens per "
                         "response position (SGLang's top_logprobs_num) and the loss adds "
                         "--opd-kl-coef x the reverse KL over them; 0: the sampled-token "
                         "advantage")
    opd_teacher_key: str | None = opt(None, "the prompt record's field naming its teacher, one "
                                      "of the NAMEs of --opd-teacher-urls NAME=URL ... (dotted: "
                                      "a nested field)")

    def validate_section(self) -> None:
        """The flags alone: they need --use-opd, the teacher of their --opd-type, lambda > 0,
        a temperature the teacher can score at, and a per-token loss."""
        if not self.use_opd:
            changed = [f for f, default in (("opd_type", "sglang"), ("opd_kl_coef", 1.0),
                                            ("opd_teacher_urls", None),
                                            ("opd_teacher_load", None),
                                            ("opd_teacher_temperature", 1.0),
                                            ("opd_top_k", 0), ("opd_teacher_key", None))
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
        if self.opd_top_k < 0:
            raise ConfigError(f"--opd-top-k must be >= 0 (0: the sampled-token estimate), got "
                              f"{self.opd_top_k}")
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
            teachers = self.teachers()
            if self.opd_teacher_key and "" in teachers:
                raise ConfigError("--opd-teacher-key picks a teacher by name: give "
                                  "--opd-teacher-urls as NAME=URL ... (e.g. math=http://a "
                                  "code=http://b)")
            if not self.opd_teacher_key and len(teachers) > 1:
                raise ConfigError(f"--opd-teacher-urls names {len(teachers)} teachers "
                                  f"({', '.join(teachers)}): add --opd-teacher-key FIELD, the "
                                  "prompt record's field that names each prompt's teacher")
        else:
            if not self.opd_teacher_load:
                raise ConfigError("--use-opd --opd-type megatron needs --opd-teacher-load DIR "
                                  "(the teacher's checkpoint)")
            if self.opd_teacher_urls:
                raise ConfigError("--opd-teacher-urls is the served teacher of --opd-type "
                                  "sglang; drop it with --opd-type megatron")
            for flag, value in (("opd_top_k", self.opd_top_k),
                                ("opd_teacher_key", self.opd_teacher_key)):
                if value:
                    raise ConfigError(f"--{flag.replace('_', '-')} needs a served teacher "
                                      "(--opd-type sglang); the checkpoint teacher scores the "
                                      "sampled token only")
        if getattr(self, "loss_type", None) == "gspo":
            raise ConfigError("--use-opd gives each token its own advantage; --loss-type gspo "
                              "takes one per response: use another --loss-type")

    def check_inputs_section(self, model: Any) -> None:
        """The teacher exists and shares the student's vocabulary: its checkpoint
        (:func:`check_megatron_teacher`), or each URL answers /model_info and serves the
        student's tokenizer."""
        if not self.use_opd:
            return
        if self.opd_type == "megatron":
            check_megatron_teacher(self, model)
            return
        from megatron_klear.rollout.orchestration.client import RolloutClient, RolloutError

        for url in (u for urls in self.teachers().values() for u in urls):
            try:
                info = RolloutClient([url], request_timeout_s=10).get_all("/model_info")
            except (RolloutError, OSError) as e:
                raise ConfigError(f"--opd-teacher-urls {url} does not answer ({e}); start the "
                                  "teacher server or fix the URL") from None
            path = next(iter(info.values())) or {}
            check_teacher_tokenizer(url, path.get("tokenizer_path") or path.get("model_path"),
                                    self.hf_checkpoint)
        if self.opd_teacher_key:
            check_teacher_routes(self.prompt_data, self.opd_teacher_key, self.teachers())

    def teachers(self) -> dict[str, list[str]]:
        """The served teachers' URLs by name (:func:`parse_teachers`)."""
        return parse_teachers(self.opd_teacher_urls or [])


def parse_teachers(items: list[str]) -> dict[str, list[str]]:
    """``--opd-teacher-urls`` as {name: URLs}: ``NAME=URL`` items by name (a name may repeat:
    one teacher behind several servers), plain URLs all under the name ``""`` (one teacher);
    ConfigError for a mix or a bad name."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or "/" in name or ":" in name:  # a plain URL (whatever '=' its query has)
            name, url = "", item
        elif not _TEACHER_NAME.fullmatch(name) or not url:
            raise ConfigError(f"--opd-teacher-urls {item}: give NAME=URL with NAME of letters, "
                              "digits, '_', '.' or '-' (e.g. math=http://127.0.0.1:30100)")
        out.setdefault(name, []).append(url)
    if "" in out and len(out) > 1:
        raise ConfigError("--opd-teacher-urls mixes plain URLs and NAME=URL: name every "
                          "teacher, or give one teacher's plain URLs")
    return out


def check_teacher_routes(path: str, key: str, teachers: dict[str, list[str]]) -> None:
    """ConfigError naming the file, line, value and choices unless every record of the prompt
    file ``path`` has a field ``key`` that names one of ``teachers``."""
    from megatron_klear.data.prompts import load_records, record_field

    for line, rec in load_records(path):
        value = record_field(rec, key)
        if str(value) not in teachers or value is None:
            raise ConfigError(f"--opd-teacher-key {key}: {path}:{line} has {value!r}, not one "
                              f"of the teachers of --opd-teacher-urls ({', '.join(teachers)}); "
                              "fix the record or add that teacher")


# --- the Megatron teacher (--opd-type megatron) ------------------------------------------
def check_megatron_teacher(cfg: Any, student: Any) -> None:
    """ConfigError naming --opd-teacher-load unless it is a Megatron checkpoint (or HF dir)
    that splits at the student's TP/PP into as many model chunks, whose padded vocabulary is
    the student's (``student``: its Qwen3Arch, None in a dry run without the model) and
    whose recorded tokenizer, when it records one on this machine, is the student's token for
    token: the teacher's log-probs must be over the student's token ids."""
    from megatron_klear.models.pipeline_layout import PipelineLayout
    from megatron_klear.models.qwen3 import check_parallel_layout, padded_vocab_size, \
        qwen3_config_from_hf
    from megatron_klear.train.frozen_policy import source_hf_config, source_tokenizer

    flag, src = "--opd-teacher-load", cfg.opd_teacher_load
    if not Path(src).is_dir():
        raise ConfigError(f"{flag} {src}: no such directory (the teacher's checkpoint)")
    teacher = qwen3_config_from_hf(source_hf_config(src, flag))
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    try:
        layout = check_parallel_layout(teacher, tp, pp,
                                       PipelineLayout.from_config(teacher.num_layers, cfg))
    except ConfigError as e:
        raise ConfigError(f"{flag} {src}: the teacher ({teacher.num_layers} layers) does not "
                          f"split at the student's layout: {e}") from None
    if student is None:
        return
    chunks = PipelineLayout.from_config(student.num_layers, cfg).num_model_chunks
    if layout.num_model_chunks != chunks:
        raise ConfigError(f"{flag} {src}: the teacher's {teacher.num_layers} layers make "
                          f"{layout.num_model_chunks} model chunks per stage, the student's "
                          f"{chunks}; drop --num-layers-per-virtual-pipeline-stage")
    mine, theirs = padded_vocab_size(student.vocab_size, tp), padded_vocab_size(
        teacher.vocab_size, tp)
    if mine != theirs:
        raise ConfigError(f"{flag} {src}: the teacher's padded vocabulary {theirs} (vocab_size "
                          f"{teacher.vocab_size}) is not the student's (--hf-checkpoint "
                          f"{cfg.hf_checkpoint}: {mine}, vocab_size {student.vocab_size}): the "
                          "teacher must share the student's tokenizer")
    tokenizer = source_tokenizer(src)
    if tokenizer and Path(tokenizer).is_dir():
        differ = vocab_difference(tokenizer, cfg.hf_checkpoint)
        if differ:
            raise ConfigError(f"{flag} {src}: its tokenizer {tokenizer} ({differ}) is not the "
                              f"student's --hf-checkpoint {cfg.hf_checkpoint}: the teacher "
                              "must share the student's tokenizer")


def vocab_difference(teacher_dir: str, student_dir: str) -> str:
    """'' when the two dirs' tokenizers have the same vocabulary token for token, else how
    they differ (both sizes and the count of differing entries)."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    student = AutoTokenizer.from_pretrained(student_dir).get_vocab()
    if teacher == student:
        return ""
    differ = len(set(teacher.items()) ^ set(student.items()))
    return f"{len(teacher)} tokens vs {len(student)}; {differ} entries differ"


# --- the served teacher (--opd-type sglang) -----------------------------------------------
def check_teacher_tokenizer(url: str, teacher_dir: str | None, student_dir: str) -> None:
    """ConfigError naming both unless the teacher's tokenizer (its server's /model_info
    ``tokenizer_path``, a directory on this machine) has the student's vocabulary, token for
    token: distillation compares the two models' log-probs of the same token ids."""
    if not teacher_dir or not Path(teacher_dir).is_dir():
        raise ConfigError(f"--opd-teacher-urls {url}: its tokenizer_path {teacher_dir!r} "
                          f"(GET /model_info) is not a directory on this machine, so its "
                          f"tokenizer cannot be checked against --hf-checkpoint {student_dir}; "
                          "serve the teacher from a path this machine also sees")
    differ = vocab_difference(teacher_dir, student_dir)
    if differ:
        raise ConfigError(f"--opd-teacher-urls {url} serves {teacher_dir}, whose tokenizer "
                          f"({differ}) is not the student's --hf-checkpoint {student_dir}: "
                          "the teacher must share the student's tokenizer")
