"""A remote reward service (``--reward-url``): rewards scored by an HTTP endpoint.

The trainer POSTs batches ``{"prompts": [...], "responses": [...], "labels": [...]}`` and
expects ``{"rewards": [float, ...]}`` in the same order (OpenRLHF's ``remote_rm_url`` and
slime's ``--rm-url`` services answer the same question one sample or one batch at a time).
Connection failures, time-outs and 5xx answers are retried with back-off; a 4xx answer or a
malformed body fails at once. When the service cannot score a batch the step fails with
:class:`RewardServiceError`: nothing of the step has been trained or checkpointed, so a rerun
resumes at the same prompts.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["RemoteReward", "RewardServiceError"]


class RewardServiceError(RuntimeError):
    """The reward service could not score a batch; the message names the URL and why."""


class _Retryable(Exception):
    pass


@dataclass
class RemoteReward:
    """Batched HTTP scoring with a per-request ``timeout`` (s) and ``retries`` after the first
    try (back-off 0.5 s, 1 s, 2 s, ...)."""

    url: str
    timeout: float = 60.0
    retries: int = 3
    batch_size: int = 256

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              labels: Sequence[Any]) -> list[float]:
        """Rewards of ``responses`` (to ``prompts``, against ``labels``), in order."""
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and "
                             f"{len(labels)} labels: one each per sample")
        out: list[float] = []
        for s in range(0, len(responses), self.batch_size):
            body = {"prompts": list(prompts[s:s + self.batch_size]),
                    "responses": list(responses[s:s + self.batch_size]),
                    "labels": list(labels[s:s + self.batch_size])}
            out += self._post_with_retries(body)
        return out

    def _post_with_retries(self, body: dict) -> list[float]:
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            try:
                return self._post(body)
            except _Retryable as exc:
                why = str(exc)
        raise self._error(f"no answer after {self.retries + 1} tries ({why})")

    def _post(self, body: dict) -> list[float]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise _Retryable(f"HTTP {exc.code}") from None
            raise self._error(f"HTTP {exc.code}: {exc.read()[:200]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None
        return self._rewards(raw, len(body["responses"]))

    def _rewards(self, raw: bytes, n: int) -> list[float]:
        try:
            rewards = json.loads(raw)["rewards"]
            values = [float(r) for r in rewards]
        except (ValueError, KeyError, TypeError):
            raise self._error(f'expected a JSON body {{"rewards": [{n} numbers]}}, got '
                              f'{raw[:200]!r}') from None
        if len(values) != n:
            raise self._error(f"answered {len(values)} rewards for {n} responses")
        return values

    def _error(self, why: str) -> RewardServiceError:
        return RewardServiceError(
            f"reward service {self.url} (--reward-url) could not score the batch: {why}. "
            "Nothing of this step was trained or saved: fix the service and rerun the same "
            "command (the run resumes from its last checkpoint, no prompt is lost)")
