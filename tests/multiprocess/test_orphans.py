"""forks_die_with_parent: a child forked without exec inside the block (multiprocessing's fork
context, as megatron-core's checkpoint writers) dies when its parent is SIGKILLed; one forked
outside it lives on (the negative control, which the block exists to fix)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

_PARENT = textwrap.dedent("""
    import multiprocessing, sys, time
    from megatron_klear.orphans import forks_die_with_parent

    def child():
        time.sleep(120)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("fork")
        guarded = sys.argv[1] == "guarded"
        if guarded:
            with forks_die_with_parent():
                p = ctx.Process(target=child)
                p.start()
        else:
            p = ctx.Process(target=child)
            p.start()
        print(p.pid, flush=True)
        time.sleep(120)
""")


def _child_after_parent_killed(tmp_path, mode: str) -> psutil.Process:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE,
                              text=True, env=env)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and child.is_running() and \
            child.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    return child


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_forked_child_dies_with_its_killed_parent(tmp_path):
    assert not _alive(_child_after_parent_killed(tmp_path, "guarded"))


def test_unguarded_fork_outlives_its_killed_parent(tmp_path):
    child = _child_after_parent_killed(tmp_path, "plain")
    try:
        assert _alive(child)
    finally:
        if _alive(child):
            child.kill()
