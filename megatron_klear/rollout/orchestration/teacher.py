"""The served teacher of on-policy distillation (issue 54): SGLang or an embedded server
scoring the student's sampled tokens.

One prefill-only ``/generate`` request per sample: ``input_ids`` = prompt + response,
``max_new_tokens`` 0, ``return_logprob`` true, ``logprob_start_len`` = len(prompt) - 1. SGLang
0.5.23 answers ``meta_info.input_token_logprobs`` = ``[[logprob, token_id, text], ...]`` for
the tokens from ``logprob_start_len`` on, the first entry's logprob always None
(sglang/srt/managers/scheduler_components/logprob_result_processor.py
``_process_input_token_logprobs``: ``[None] + input_token_logprobs[:-1]``); so the entries after
the first are the response tokens' log-probs given everything before them. SGLang computes them
from the unscaled logits (sglang/srt/layers/logprob_processor.py), i.e. at temperature 1,
whatever ``sampling_params.temperature`` says; the flags refuse another teacher temperature.

Prefix cache: keyed, not flushed. Every request of one :class:`TeacherClient` carries its own
``cache_salt`` (SGLang's cache namespace, sglang/srt/managers/io_struct.py
``GenerateReqInput.cache_salt``), so the teacher reuses only prefixes this client computed, with
the weights it scores with (a teacher's weights do not change during a run); nothing cached
before (another model version behind the same URL, another client) is reused. A flush would
do the same only while the teacher is idle: SGLang refuses ``/flush_cache`` when busy.

Top-k (``--opd-top-k K``): the request adds ``top_logprobs_num`` K
(sglang/srt/managers/io_struct.py ``GenerateReqInput.top_logprobs_num``); the reply's
``meta_info.input_top_logprobs`` then holds, aligned with ``input_token_logprobs``, one row per
token from ``logprob_start_len`` on, the first None, each row K ``[logprob, token_id, text]``
sorted by logprob, descending (sglang/srt/managers/scheduler_components/
logprob_result_processor.py ``_process_input_top_logprobs``; sglang/srt/layers/
logprob_processor.py ``get_top_logprobs_raw``: ``logprobs.topk``): the teacher's K most likely
tokens at each response position, full-vocabulary log-probs.

Several teachers: :class:`TeacherClient` takes the teachers by name, each with its URLs, and a
route from a sample's prompt (its dataset index) to its teacher's name (``--opd-teacher-key``:
a field of the prompt record, train/opd_flags.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from megatron_klear.rollout.orchestration.client import RolloutClient, RolloutError
from megatron_klear.samples import Sample

__all__ = ["TeacherClient", "TeacherScores", "prefill_request", "response_logprobs",
           "response_top_logprobs"]


def prefill_request(prompt_ids: Sequence[int], response_ids: Sequence[int],
                    cache_salt: str | None = None, top_k: int = 0) -> dict:
    """The prefill-only /generate body that scores ``response_ids`` after ``prompt_ids``
    (``cache_salt``: the prefix-cache namespace it may reuse entries of; ``top_k`` > 0: also
    the teacher's ``top_k`` most likely tokens at each position)."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    top = {"top_logprobs_num": top_k} if top_k else {}
    return {**salt, **top, "input_ids": list(prompt_ids) + list(response_ids), "return_logprob": True,
            "logprob_start_len": max(len(prompt_ids) - 1, 0),
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}


def response_logprobs(reply: dict, prompt_ids: Sequence[int], response_ids: Sequence[int]
                      ) -> list[float]:
    """The response tokens' log-probs in a reply to :func:`prefill_request`; RolloutError when
    the reply's tokens are not the response's (a server that scored something else)."""
    entries = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
    skip = 1 if prompt_ids else 0  # the entry of the prompt's last token (None in SGLang)
    got = entries[skip:]
    if [int(e[1]) for e in got] != list(response_ids):
        raise RolloutError(f"teacher's input_token_logprobs hold {len(got)} tokens that are "
                           f"not the {len(response_ids)} response tokens sent; is the teacher "
                           "an SGLang-compatible /generate server?")
    return [float(e[0]) for e in got]


def response_top_logprobs(reply: dict, prompt_ids: Sequence[int], response_ids: Sequence[int],
                          k: int) -> tuple[list[list[int]], list[list[float]]]:
    """(ids, log-probs), per response token ``k`` each: the teacher's ``k`` most likely tokens
    at the position that predicts it, from a reply to :func:`prefill_request` with ``top_k``;
    RolloutError when the reply holds another number of rows or of tokens per row."""
    rows = ((reply.get("meta_info") or {}).get("input_top_logprobs") or [])[
        1 if prompt_ids else 0:]
    if len(rows) != len(response_ids) or any(row is None or len(row) != k for row in rows):
        raise RolloutError(f"teacher's input_top_logprobs hold {len(rows)} rows, not the "
                           f"{len(response_ids)} response positions with {k} tokens each; is "
                           "the teacher an SGLang-compatible /generate server that takes "
                           "top_logprobs_num?")
    return ([[int(e[1]) for e in row] for row in rows],
            [[float(e[0]) for e in row] for row in rows])


@dataclass
class TeacherScores:
    """One sample's teacher scores: the log-prob of each response token and, with top-k, the
    ``k`` most likely ids and their log-probs at each response position."""

    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


class TeacherClient:
    """Scores samples' response tokens with the teacher server(s).

    ``teachers``: the teachers' URLs, a list (one teacher) or by name (several); ``route``
    (with names): a prompt's dataset index -> its teacher's name. ``top_k`` > 0: also the
    teacher's top-k log-probs of each response position."""

    def __init__(self, teachers: Sequence[str] | Mapping[str, Sequence[str]],
                 route: Callable[[int], str] | None = None, top_k: int = 0,
                 **client: Any) -> None:
        named = dict(teachers) if isinstance(teachers, Mapping) else {"": list(teachers)}
        if len(named) > 1 and route is None:
            raise ValueError("several teachers need a route from a prompt to a teacher's name")
        self.clients = {name: RolloutClient(list(urls), **client) for name, urls in named.items()}
        self.route = route if route is not None else (lambda _: next(iter(named)))
        self.top_k = top_k
        self.cache_salt = f"klear-opd-{uuid.uuid4().hex}"  # this client's cache namespace

    def scores(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
               teacher: str | None = None) -> list[TeacherScores]:
        """The scores of each (prompt, response) pair by ``teacher`` (a name; default: the
        only one)."""
        client = self.clients[next(iter(self.clients)) if teacher is None else teacher]
        replies = client.post_balanced("/generate", [prefill_request(p, r, self.cache_salt,
                                                                     self.top_k)
                                                     for p, r in pairs])
        out = []
        for reply, (p, r) in zip(replies, pairs):
            top = response_top_logprobs(reply, p, r, self.top_k) if self.top_k else (None, None)
            out.append(TeacherScores(response_logprobs(reply, p, r), *top))
        return out

    def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                 teacher: str | None = None) -> list[list[float]]:
        """The teacher's log-prob of each response token of each (prompt, response) pair."""
        return [s.logprobs for s in self.scores(pairs, teacher)]

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set each sample's teacher fields, each scored by its prompt's teacher; returns the
        wall seconds each teacher took (``time/teacher_s``, and ``time/teacher_<name>_s`` per
        named teacher when there are several, 0 for one no sample of the batch named)."""
        times = {f"time/teacher_{name}_s": 0.0 for name in self.clients}
        by_teacher: dict[str, list[Sample]] = {}
        for s in samples:
            by_teacher.setdefault(self.route(s.prompt_index), []).append(s)
        for name, group in by_teacher.items():
            if name not in self.clients:
                raise RolloutError(f"prompt {group[0].prompt_index} names teacher {name!r}, "
                                   f"not one of {sorted(self.clients)}")
            t0 = time.time()
            for s, got in zip(group, self.scores([(s.prompt_ids, s.response_ids)
                                                  for s in group], name)):
                s.teacher_logprobs = got.logprobs
                s.teacher_topk_ids, s.teacher_topk_logprobs = got.topk_ids, got.topk_logprobs
            times[f"time/teacher_{name}_s"] = time.time() - t0
        total = sum(times.values())
        return {"time/teacher_s": total, **(times if len(self.clients) > 1 else {})}
