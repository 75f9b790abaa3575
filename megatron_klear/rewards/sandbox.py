"""Run untrusted Python programs in isolated, resource-limited processes.

Each run gets a private temp work dir, an unprivileged per-run uid (so RLIMIT_NPROC holds
even when we are root), new network/mount/pid namespaces, rlimits, an allow-listed
environment, wall and CPU time limits and an output cap; afterwards every process of the
run is killed and the work dir removed. The isolation itself happens in
``sandbox_launcher.py`` (a fresh interpreter); see docs/rewards.md.

``SandboxPool`` runs many programs with a bounded number of concurrent sandboxes.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from megatron_klear.rewards.sandbox_launcher import SETUP_FAILED


# the OpenAI tool schema of a program run here: the python tool's (rollout/orchestration/
# tools.py), and the one the synthetic tool data (data/synthetic.py) writes into records
PYTHON_SCHEMA = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program and see what it prints (stdout, then stderr).",
    "parameters": {"type": "object", "properties": {"code": {
        "type": "string", "description": "the program"}}, "required": ["code"]}}}

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
RESULT_FILE = "klear_result.json"
UID_BASE, UID_SPAN = 1 << 20, 1 << 20  # per-run uids, far above any real account
SANDBOX_ENV = {  # the ONLY variables the untrusted program sees
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxError(RuntimeError):
    """The sandbox could not be set up (not a failure of the program under test)."""


# A CPU-bound run's wall limit, as a multiple of its CPU limit (see SandboxLimits.cpu_bound)
WALL_BACKSTOP = 4.0


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run. ``wall_s`` is enforced by the parent; ``cpu_s`` (default:
    ``wall_s``) by the kernel (RLIMIT_CPU), per process, in whole seconds rounded up."""

    wall_s: float = 3.0
    cpu_s: float | None = None
    memory_mb: int = 512
    max_processes: int = 16
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    open_files: int = 64

    @classmethod
    def cpu_bound(cls, cpu_s: float, **kw: int) -> "SandboxLimits":
        """Limits whose verdict is the program's CPU time, which the machine's load does not
        change (a wall limit does: a program that passes on idle cores times out on busy
        ones). The wall limit, ``WALL_BACKSTOP`` x ``cpu_s`` + 1 s, only stops programs that
        block without computing."""
        return cls(wall_s=WALL_BACKSTOP * cpu_s + 1.0, cpu_s=cpu_s, **kw)


@dataclass
class SandboxJob:
    """One program: ``files`` are written to the work dir, then ``python -I main *args``."""

    files: Mapping[str, str | bytes]
    main: str
    args: tuple[str, ...] = ()
    stdin: bytes = b""
    limits: SandboxLimits = field(default_factory=SandboxLimits)


@dataclass
class SandboxResult:
    """What came out of one run; ``result`` is the content of RESULT_FILE (capped)."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    result: bytes | None
    timed_out: bool
    output_exceeded: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        """Exited 0 within all limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


_active_uids: set[int] = set()
_uid_lock = threading.Lock()


def _claim_uid() -> int:
    with _uid_lock:
        while True:
            uid = UID_BASE + secrets.randbelow(UID_SPAN)
            if uid not in _active_uids:
                _active_uids.add(uid)
                return uid


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _active_uids.discard(uid)


def _prepare_workdir(files: Mapping[str, str | bytes], uid: int | None) -> str:
    workdir = tempfile.mkdtemp(prefix="klear-sbx-")
    for name, content in files.items():
        if os.path.isabs(name) or ".." in name.split("/"):
            raise ValueError(f"sandbox file name {name!r} must be relative, without '..'")
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    if uid is not None:
        for dirpath, dirnames, filenames in os.walk(workdir):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                os.chown(name, uid, uid)
    return workdir


def _procs_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _kill_run(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the launcher's process group, then every process still owned by the run uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if uid is None:
        return
    deadline = time.monotonic() + 5.0
    while (pids := _procs_of_uid(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    if _procs_of_uid(uid):
        raise SandboxError(f"could not kill all processes of sandbox uid {uid}")


def _pump(proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, collect stdout/stderr up to the cap, until exit or the wall deadline."""
    sel = selectors.DefaultSelector()
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for f in out:
        sel.register(f, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)  # a program that never reads must not block us
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    view, deadline = memoryview(stdin), time.monotonic() + limits.wall_s
    timed_out = exceeded = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            if key.fileobj is proc.stdin:
                try:
                    view = view[os.write(proc.stdin.fileno(), view[:65536]):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    view = view[:0]
                if not view:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            out[key.fileobj] += chunk
        if sum(map(len, out.values())) > limits.output_bytes:
            exceeded = True
            break
    sel.close()
    cap = limits.output_bytes
    return bytes(out[proc.stdout][:cap]), bytes(out[proc.stderr][:cap]), timed_out, exceeded


def _read_result(workdir: str, cap: int) -> bytes | None:
    path = os.path.join(workdir, RESULT_FILE)
    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return None
        with open(path, "rb") as f:
            return f.read(cap)
    except OSError:
        return None


# The bare base interpreter (stdlib only), never the venv's: a venv may live under /tmp,
# which the sandbox hides behind its private work dir.
BASE_PYTHON = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def run_python(job: SandboxJob) -> SandboxResult:
    """Run ``job`` in a fresh sandbox and return its outputs; never leaves a process behind."""
    lim = job.limits
    root = os.geteuid() == 0
    uid = _claim_uid() if root else None
    workdir = _prepare_workdir(job.files, uid)
    try:
        cfg = {"workdir": workdir, "uid": uid, "cpu_s": lim.cpu_s or lim.wall_s,
               "memory_mb": lim.memory_mb, "max_processes": lim.max_processes,
               "file_bytes": lim.file_bytes, "open_files": lim.open_files,
               "env": SANDBOX_ENV, "prefix": os.path.realpath(sys.base_prefix),
               "argv": [BASE_PYTHON, "-I", job.main, *job.args]}
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=SANDBOX_ENV, start_new_session=True, close_fds=True)
        try:
            stdout, stderr, timed_out, exceeded = _pump(proc, job.stdin, lim)
            if not (timed_out or exceeded):
                try:
                    proc.wait(max(0.0, start + lim.wall_s - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill_run(proc, uid)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
        wall = time.monotonic() - start
        if proc.returncode == SETUP_FAILED and b"sandbox setup failed" in stderr:
            raise SandboxError(stderr.decode(errors="replace").strip())
        return SandboxResult(None if timed_out else proc.returncode, stdout, stderr,
                             _read_result(workdir, lim.output_bytes), timed_out, exceeded, wall)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            _release_uid(uid)


def default_workers() -> int:
    """One sandbox per usable core."""
    return max(1, len(os.sched_getaffinity(0)))


class SandboxPool:
    """Runs sandbox jobs with at most ``max_workers`` running at once (thread-safe)."""

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers or default_workers()
        self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")

    def map(self, jobs: Iterable[SandboxJob]) -> list[SandboxResult]:
        """Run all jobs (in parallel up to the bound); results in job order."""
        return list(self._executor.map(run_python, jobs))

    def close(self) -> None:
        """Wait for running jobs and stop the worker threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: SandboxPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> SandboxPool:
    """The process-wide default pool (one worker per core), created on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SandboxPool()
        return _shared
