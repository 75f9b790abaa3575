"""Where the RL trainer's batches come from: generated on demand, or ahead of time.

Synchronous (the default): step s's batch is generated when step s starts, by the servers
holding the trainer's current weights.

Asynchronous (``--async-rollout``, one-step off-policy when ``--max-staleness 1``): while the
trainer trains on step s, one background thread on global rank 0 generates the batches of steps
s+1 .. s+max_staleness on the rollout servers. A batch starts generating with the weights the
servers hold at that moment, so the batch trained at step s was generated with weights at most
``max_staleness`` updates old (``rollout/staleness``; the weight syncs still happen every step
and hit the requests in flight, see ``--async-inflight``). The trainer recomputes the old
log-probs itself, so the PPO ratio is against its own pi_old; ``--rollout-correction`` weighs
the gap between the (stale) rollout policy and pi_old.

Resume: a checkpoint stores the data cursor of the last *trained* batch only. Batches generated
ahead are not saved: on resume they are drawn again from that cursor (same prompts in the same
order, same per-prompt sampling seeds) and generated with the resumed weights, so no prompt is
lost or repeated.
"""

from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass
from typing import Callable

from megatron_klear.samples import RolloutBatch
from megatron_klear.train.rl_data import PromptStream


@dataclass
class StepBatch:
    """One training step's batch and where it came from."""

    batch: RolloutBatch
    cursor: int   # prompts consumed from the stream once this batch was drawn
    version: int  # weight version (trainer step) the servers held when its generation began


class RolloutSource:
    """The batches of successive training steps (used on global rank 0 only).

    ``collect()`` draws prompts from ``stream`` and returns a finished batch; ``ahead`` is how
    many later steps' batches are generated while a step trains (0: synchronous).
    """

    def __init__(self, collect: Callable[[], RolloutBatch], stream: PromptStream, *,
                 ahead: int, last_step: int, version: int) -> None:
        self.collect, self.stream, self.ahead, self.last_step = collect, stream, ahead, last_step
        self.version = version  # the weights the servers hold now
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._queue: collections.deque[concurrent.futures.Future] = collections.deque()
        self._next_submit: int | None = None  # the first step not yet queued

    def _generate(self) -> StepBatch:
        version = self.version  # read when generation begins, not when it was queued
        batch = self.collect()
        return StepBatch(batch, self.stream.consumed, version)

    def next(self, step: int) -> StepBatch:
        """The batch of training step ``step`` (0-based); asynchronously, also queue the
        batches of steps step+1 .. step+ahead (none past the last step) before waiting."""
        if not self.ahead:
            return self._generate()
        if self._next_submit is None:
            self._next_submit = step
        while self._next_submit <= min(step + self.ahead, self.last_step - 1):
            self._queue.append(self._pool.submit(self._generate))
            self._next_submit += 1
        return self._queue.popleft().result()

    def weights_updated(self, version: int) -> None:
        """The servers now hold the weights of trainer step ``version``."""
        self.version = version

    def close(self) -> None:
        """Drop queued batches and wait for the one being generated (it talks to the servers,
        which must outlive it)."""
        for future in self._queue:
            future.cancel()
        self._pool.shutdown(wait=True)
