"""freeze_startup_heap: what is alive at the call leaves the collector's generations (later full
collections skip it), and what is allocated afterwards is still collected. keep_freed_memory:
a freed buffer's pages are reused, not faulted in again."""

import subprocess
import sys


_FREEZE = """
import gc, weakref
from megatron_klear.heap import freeze_startup_heap
class Node:
    pass
before = Node()
freeze_startup_heap()
frozen = gc.get_freeze_count()
assert frozen > 1000, frozen  # the interpreter's and this script's objects
assert before not in gc.get_objects()  # out of every generation the collector scans
later = Node()
later.self = later  # a cycle: only the collector frees it
ref = weakref.ref(later)
del later
gc.collect()
assert ref() is None
assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)
"""


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    """In a fresh interpreter of its own: in pytest's, other threads (a pytest-xdist worker's)
    may free frozen objects meanwhile and move the freeze count."""
    run = subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


_REFAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from megatron_klear.heap import keep_freed_memory
    keep_freed_memory()
def faults_of_a_step(floats):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(floats).fill_(1.0) for _ in range(8)]  # 8 x ~1 MB: ~2048 pages
    del buffers
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = [faults_of_a_step((1 << 18) + step * 1024) for step in range(8)]
print(max(faults[2:]))
"""


def _refaults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[-1])


def test_freed_memory_is_reused_without_page_faults():
    """Steps whose buffers grow a little each time (8 x ~1 MB, as a decode batch's KV cache
    with longer prompts): glibc's default maps each new size afresh, so every step faults its
    ~2048 pages in again; after keep_freed_memory a step reuses the pages the last one freed."""
    assert _refaults("default") > 2000
    assert _refaults("keep") < 500  # the growth itself, and some fragmentation
