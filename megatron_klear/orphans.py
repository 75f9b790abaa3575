"""Child processes that do not outlive their parent (no orphans after a SIGKILLed trainer).

Two mechanisms, one per side of the fork:

* :func:`die_with_parent` -- a ``preexec_fn`` for ``subprocess.Popen``: Linux's
  ``PR_SET_PDEATHSIG`` sends the child SIGTERM when the parent dies. It fires when the
  *thread* that forked the child exits, so use it only for children started from a thread
  that lives as long as the parent (the launcher's main thread);
* :func:`exit_when_orphaned` -- called inside a long-lived child (the math-verifier workers,
  which reward threads start, and the embedded rollout server): a daemon thread exits the
  process once its parent is gone (it has been re-parented).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

__all__ = ["die_with_parent", "exit_when_orphaned"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM this child when its parent (thread) dies (Linux; else no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: callers still stop their children on orderly exits
        pass


def exit_when_orphaned(poll_s: float = 1.0, code: int = 0) -> None:
    """Exit this process (``os._exit``) within ``poll_s`` of its parent's death."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(code)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()
