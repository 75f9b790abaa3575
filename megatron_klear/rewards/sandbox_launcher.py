"""Isolating launcher for one untrusted program (stdlib only; run as a script).

Started by ``megatron_klear.rewards.sandbox`` as ``python -I -S sandbox_launcher.py CONFIG``
with an allow-listed environment. It must be a separate fresh interpreter: namespaces,
mounts, rlimits and uid changes cannot be applied safely from the multi-threaded parent
(``preexec_fn`` is not thread-safe).

Steps:
1. ``unshare`` new network, mount and pid namespaces (plus a user namespace when not root):
   the program sees only a down loopback device and cannot open a connection.
2. ``fork``: the child is pid 1 of the new pid namespace. When it dies the kernel kills
   every other process in that namespace, so nothing the program spawned survives it.
3. The child bind-mounts the private work dir over every world-writable directory
   (/tmp, /var/tmp, /dev/shm, /run/lock), mounts a private /proc, sets rlimits (address
   space, CPU, processes, file size, open files, no core), drops to the unprivileged
   per-run uid (so RLIMIT_NPROC is enforced even when the caller is root), asks for
   SIGKILL when the launcher dies, and execs the program.
4. The launcher waits and exits with the child's status (128 + signal when killed).
"""

import ctypes
import json
import math
import os
import resource
import select
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
SIGKILL = 9
PRIVATE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/tmp")  # /tmp last: it hides the work dir
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> None:
    err = ctypes.get_errno()
    os.write(2, f"sandbox setup failed: {what}: {os.strerror(err)}\n".encode())
    os._exit(SETUP_FAILED)


def _unshare(root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    uid, gid = os.getuid(), os.getgid()
    if not root:
        flags |= CLONE_NEWUSER
    if _libc.unshare(flags) != 0:
        _fail("unshare(net, mount, pid)")
    if not root:  # map ourselves to ourselves so the real uid (and RLIMIT_NPROC) is unchanged
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")


def _mount(src: bytes | None, dst: str, fstype: bytes | None, flags: int) -> int:
    return _libc.mount(src, dst.encode(), fstype, flags, None)


def _hidden_ancestor(path: str) -> str | None:
    """The top-most ancestor of ``path`` that other users cannot traverse (e.g. /root)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        anc = "/" + "/".join(parts[:i])
        if not os.stat(anc).st_mode & 0o001:
            return anc
    return None


def _reveal_interpreter(prefix: str, workdir: str) -> None:
    """Make the interpreter at ``prefix`` reachable by the sandbox uid when it lives under an
    untraversable dir (pyenv in /root): hide that dir behind an empty tmpfs and bind only
    the interpreter prefix back into it. Everything else there stays invisible."""
    top = _hidden_ancestor(prefix)
    if top is None:
        return
    stash = os.path.join(workdir, ".klear-prefix")
    os.mkdir(stash)
    if _mount(prefix.encode(), stash, None, MS_BIND | MS_REC) != 0:
        _fail(f"bind {prefix}")
    if _mount(b"tmpfs", top, b"tmpfs", MS_NOSUID | MS_NODEV) != 0:
        _fail(f"tmpfs over {top}")
    os.chmod(top, 0o755)
    os.makedirs(prefix, mode=0o755, exist_ok=True)
    if _mount(stash.encode(), prefix, None, MS_BIND | MS_REC) != 0:
        _fail(f"re-bind {prefix}")
    _libc.umount2(stash.encode(), MNT_DETACH)
    os.rmdir(stash)


def _private_filesystem(workdir: str, prefix: str) -> None:
    if _mount(b"none", "/", None, MS_REC | MS_PRIVATE) != 0:
        _fail("make mounts private")
    _reveal_interpreter(prefix, workdir)
    for d in PRIVATE_DIRS:
        if os.path.isdir(d) and _mount(workdir.encode(), d, None, MS_BIND) != 0:
            _fail(f"bind {workdir} over {d}")
    # A fresh /proc shows only this pid namespace; where the host masks /proc this may be
    # refused, and the program then sees host pids it still cannot signal (other uid).
    _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir("/tmp")


def _limits(cfg: dict) -> None:
    cpu = math.ceil(cfg["cpu_s"])  # soft = hard: the kernel SIGKILLs the process there
    mem = cfg["memory_mb"] << 20
    for res, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_NPROC, cfg["max_processes"]),
                     (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
                     (resource.RLIMIT_NOFILE, cfg["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (val, val))


def _child(cfg: dict, root: bool, alive_r: int) -> None:
    _private_filesystem(cfg["workdir"], cfg["prefix"])
    _limits(cfg)
    if root:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    # Set after the uid change (a credential change clears it). The pipe closes when the
    # launcher dies, which catches the race where it died before this prctl.
    if _libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0:
        _fail("prctl(PR_SET_PDEATHSIG)")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(SETUP_FAILED)
    os.close(alive_r)
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    root = os.geteuid() == 0
    _unshare(root)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            _child(cfg, root, alive_r)
        except BaseException as exc:  # noqa: BLE001 - report any setup error, never continue
            os.write(2, f"sandbox setup failed: {exc!r}\n".encode())
        os._exit(SETUP_FAILED)
    os.close(alive_r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
