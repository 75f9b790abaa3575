"""The kill point of the SIGKILL-and-resume tests: a trainer (or klear-eval) killed once its
metrics (or samples) file holds N whole lines, and its children checked gone.

test_sft.py freezes the trainer before it kills (``_stop_when``): its kill points are a
save in flight, which a poll alone could miss.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.rollout_helpers import cmdline


def kill_when_logged(proc: subprocess.Popen, metrics: Path, lines: int, *, group: bool = False,
                     timeout: float = 300) -> list[str]:
    """SIGKILL ``proc`` once ``metrics`` holds ``lines`` whole lines, and return the command lines
    of its descendants at that moment, all of them gone within 20 s.

    ``group=False`` kills the trainer alone: its children must die with it (the trainer's
    promise, checkpoint/state.py). ``group=True`` is a node lost: the process group (``proc``
    started with ``start_new_session=True``) and every descendant, since torchrun's ranks sit
    in sessions of their own and a group kill alone misses them (seen: 5 more steps logged).
    """
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= lines:
            family = psutil.Process(proc.pid).children(recursive=True)
            kinds = [cmdline(p) for p in family]
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
                for p in family:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
            else:
                proc.send_signal(signal.SIGKILL)
            proc.communicate()
            assert proc.returncode == -signal.SIGKILL, proc.returncode
            _, alive = psutil.wait_procs(family, timeout=20)
            assert not alive, [cmdline(p) for p in alive]
            return kinds
        time.sleep(0.01)
    proc.kill()
    _, err = proc.communicate()
    err = err.decode(errors="replace") if isinstance(err, bytes) else err or ""
    raise AssertionError(f"{metrics}: the run ended (exit {proc.returncode}) or ran past "
                         f"{timeout:.0f} s before line {lines} was logged\n{err[-3000:]}")
