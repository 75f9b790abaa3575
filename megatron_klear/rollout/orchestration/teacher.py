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
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

from megatron_klear.rollout.orchestration.client import RolloutClient, RolloutError
from megatron_klear.samples import Sample

__all__ = ["TeacherClient", "prefill_request", "response_logprobs"]


def prefill_request(prompt_ids: Sequence[int], response_ids: Sequence[int],
                    cache_salt: str | None = None) -> dict:
    """The prefill-only /generate body that scores ``response_ids`` after ``prompt_ids``
    (``cache_salt``: the prefix-cache namespace it may reuse entries of)."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    return {**salt, "input_ids": list(prompt_ids) + list(response_ids), "return_logprob": True,
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


class TeacherClient:
    """Scores samples' response tokens with the teacher server(s) at ``urls``."""

    def __init__(self, urls: Sequence[str], **client: Any) -> None:
        self.client = RolloutClient(list(urls), **client)
        self.cache_salt = f"klear-opd-{uuid.uuid4().hex}"  # this client's cache namespace

    def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """The teacher's log-prob of each response token of each (prompt, response) pair."""
        replies = self.client.post_balanced("/generate",
                                            [prefill_request(p, r, self.cache_salt)
                                             for p, r in pairs])
        return [response_logprobs(reply, p, r) for reply, (p, r) in zip(replies, pairs)]

    def score(self, samples: list[Sample]) -> float:
        """Set each sample's ``teacher_logprobs``; returns the wall seconds it took."""
        t0 = time.time()
        for s, lps in zip(samples, self.logprobs([(s.prompt_ids, s.response_ids)
                                                  for s in samples])):
            s.teacher_logprobs = lps
        return time.time() - t0
