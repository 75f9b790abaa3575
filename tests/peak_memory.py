"""Peak live tensor bytes of a piece of CPU work, from the allocator (see tests/multiprocess/test_memory.py
for why this and not RSS: RSS also sees the allocator's caching, the Python heap and the
libraries, and a process's earlier peak hides a smaller later one)."""

from __future__ import annotations

import json
import os
import tempfile


def peak_allocated_bytes(fn) -> int:
    """Run ``fn()`` under the profiler; the peak of the CPU allocator's live-byte total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    # c10's running total is process-wide and keeps the bytes of tensors that an earlier
    # profiling window allocated but freed outside any window: a constant offset, read off
    # the first event of this window (its total before its own allocation or free).
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base
