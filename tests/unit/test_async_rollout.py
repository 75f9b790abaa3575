"""RolloutSource's queue on its own (the end-to-end async run is in tests/multiprocess/test_rl.py).

``collect`` here stands in for rl_data.collect_batch: it draws from the real PromptStream and
returns a RolloutBatch of the drawn prompts, as collect_batch does with --no-dynamic-sampling.
"""

import threading
import time

import pytest

from megatron_klear.data.prompts import PromptSample
from megatron_klear.samples import RolloutBatch
from megatron_klear.train.async_rollout import RolloutSource
from megatron_klear.train.rl_data import PromptStream


def _source(ahead: int, steps: int, calls: list):
    stream = PromptStream([PromptSample(i, [], None) for i in range(40)], seed=1)

    def collect() -> RolloutBatch:
        calls.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.01)  # generation takes a while
        batch = RolloutBatch(1)
        batch.prompt_index = [p.index for _, p in stream.take(4)]
        return batch

    return RolloutSource(collect, stream, ahead=ahead, last_step=steps, version=0)


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_batches_in_order_staleness_bounded_none_past_the_end(ahead):
    calls: list = []
    source = _source(ahead, 6, calls)
    expected = PromptStream([PromptSample(i, [], None) for i in range(40)], seed=1).take(24)
    staleness = []
    try:
        for step in range(6):
            got = source.next(step)
            assert got.cursor == 4 * (step + 1)  # the stream position after this batch
            assert got.batch.prompt_index == [p.index for _, p in expected[4 * step:4 * step + 4]]
            staleness.append(step - got.version)
            time.sleep(0.2)  # "training": the batches ahead start before it ends
            source.weights_updated(step + 1)
    finally:
        source.close()
    assert len(calls) == 6  # nothing generated for a step past --train-iters
    assert all(0 <= s <= ahead for s in staleness), staleness
    if ahead == 0:
        assert staleness == [0] * 6 and all(calls)  # synchronous: generated on the caller
    else:
        assert not any(calls) and max(staleness) == ahead  # generated ahead, on the thread


@pytest.mark.parametrize("argv,msg", [
    (["--async-rollout", "--max-staleness", "0"], "--max-staleness must be >= 1"),
    (["--max-staleness", "2"], "apply to --async-rollout only"),
    (["--async-inflight", "abort"], "apply to --async-rollout only"),
])
def test_async_flags_errors_name_the_flag(argv, msg):
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl import RLConfig

    required = ["--hf-checkpoint", "x", "--prompt-data", "x"]
    with pytest.raises(ConfigError, match=msg):
        parse_config(RLConfig, required + argv)
    cfg = parse_config(RLConfig, required + ["--async-rollout", "--max-staleness", "2",
                                             "--async-inflight", "abort"])
    assert (cfg.max_staleness, cfg.async_inflight) == (2, "abort")


def test_prompt_stream_epochs_are_seeded_permutations_and_resume_mid_epoch():
    """Each epoch draws every prompt once, in the order of a shuffle seeded by (seed, epoch)
    (the order checkpoints resume by: a changed order would change resumed runs' data); a
    stream started at a position continues exactly where the first one was."""
    import random

    prompts = [PromptSample(i, [], None) for i in range(7)]
    drawn = [(pos, p.index) for pos, p in PromptStream(prompts, seed=3).take(17)]
    expected = []
    for epoch in range(3):
        order = list(range(7))
        random.Random(3 * 7919 + epoch).shuffle(order)
        expected += order
    assert drawn == list(enumerate(expected[:17]))
    resumed = PromptStream(prompts, seed=3, consumed=9)
    assert [(pos, p.index) for pos, p in resumed.take(8)] == drawn[9:]
