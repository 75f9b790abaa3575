"""freeze_startup_heap: what is alive at the call leaves the collector's generations (later full
collections skip it), and what is allocated afterwards is still collected."""

import gc
import weakref

from megatron_klear.heap import freeze_startup_heap


class _Node:
    pass


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    before = _Node()
    gc.unfreeze()
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's and this test session's objects
        assert before not in gc.get_objects()  # out of every generation the collector scans
        later = _Node()
        later.self = later  # a cycle: only the collector frees it
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
