"""Child processes that do not outlive their parent (no orphans after a SIGKILLed trainer).

Two mechanisms, one per side of the fork:

* :func:`die_with_parent` -- a ``preexec_fn`` for ``subprocess.Popen``: Linux's
  ``PR_SET_PDEATHSIG`` sends the child SIGTERM when the parent dies. It fires when the
  *thread* that forked the child exits, so use it only for children started from a thread
  that lives as long as the parent (the launcher's main thread);
* :func:`forks_die_with_parent` -- a block during which the children that Python forks
  without exec (``multiprocessing``'s fork context: megatron-core's checkpoint writers) get
  the same parent-death signal, SIGKILL;
* :func:`exit_when_orphaned` -- called inside a long-lived child (the math-verifier workers,
  which reward threads start, and the embedded rollout server): a daemon thread exits the
  process once its parent is gone (it has been re-parented).

:func:`exit_with_launcher` applies the second to every console script run under torchrun,
whose agent starts each worker in a session of its own: a SIGKILLed agent would otherwise
leave its ranks (and what they started) running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import Iterator

__all__ = ["die_with_parent", "exit_when_orphaned", "exit_with_launcher", "forks_die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn``: send this child ``sig`` when its parent (thread) dies (Linux; else
    no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # not Linux: callers still stop their children on orderly exits
        pass


_FORK_GUARD: dict = {"parent": None, "hooked": False}


def _forked_child() -> None:
    parent = _FORK_GUARD["parent"]
    if parent is None:
        return
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


@contextlib.contextmanager
def forks_die_with_parent() -> Iterator[None]:
    """Children forked without exec inside this block (by any thread) die with this process.

    megatron-core's checkpoint writer forks worker processes (``filesystem_async``, fork
    context) that block forever on their queues when the trainer is SIGKILLed mid-save (one
    outlived a killed trainer by over a minute in tests/multiprocess/test_rollout_faults.py). Enter the
    block in a thread that lives as long as the process (the signal fires when the forking
    thread exits). ``subprocess`` children without ``preexec_fn`` run no at-fork hook and are
    not affected."""
    if not _FORK_GUARD["hooked"]:
        os.register_at_fork(after_in_child=_forked_child)
        _FORK_GUARD["hooked"] = True
    _FORK_GUARD["parent"] = os.getpid()
    try:
        yield
    finally:
        _FORK_GUARD["parent"] = None


def exit_when_orphaned(poll_s: float = 1.0, code: int = 0, *, kill_group: bool = False) -> None:
    """Exit this process (``os._exit``) within ``poll_s`` of its parent's death.

    ``kill_group``: SIGKILL this process's whole process group instead (it must lead the
    group), which takes the children it started in the group along at once.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if kill_group:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(code)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def exit_with_launcher(poll_s: float = 1.0) -> bool:
    """Under torchrun, end this rank and the process group it leads once the agent dies.

    torchrun starts each worker with ``start_new_session``, so the agent's death signals
    nobody. Only torchrun workers (``TORCHELASTIC_RUN_ID`` set) are watched: a script run
    from a shell keeps running when that shell goes away (nohup). The group takes the
    rank's in-group children (math-verifier workers, megatron's writer manager); the
    rollout and SGLang servers, which have sessions of their own, follow through their
    parent-death signal (:func:`die_with_parent`) and their own :func:`exit_when_orphaned`.
    Returns whether a watchdog was started.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    exit_when_orphaned(poll_s, code=1, kill_group=os.getpgrp() == os.getpid())
    return True
