"""Hostile programs: each must score 0, finish within its limit, leave no process and no
file behind, and leave the parent unharmed. Where an attack would fool a naive harness,
a negative control shows that it really does."""

import http.server
import json
import os
import secrets
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_klear.rewards import sandbox
from megatron_klear.rewards.code import code_reward
from megatron_klear.rewards.sandbox import (SANDBOX_ENV, SandboxJob,
                                            SandboxLimits, run_python)

LIMIT_S = 1.5
SLACK_S = 5.0  # process start, kill and clean-up on a 2-core machine shared by 5 engineers
ADD = {"inputs": ["2 3\n", "10 20\n"], "outputs": ["5", "30"]}
ADD_OK = "a, b = map(int, input().split())\nprint(a + b)\n"
HUMANEVAL = {"entry_point": "add", "test": "def check(candidate):\n"
             "    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n"}


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


class _Runs:
    """The sandbox runs a test starts in this process (work dir and uid of each), so the
    leftover checks see this test's runs only, not those of a test beside it (pytest-xdist)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, int | None]] = []

    def procs(self) -> list:
        """Live processes of these runs: their uids' and their launchers."""
        uids = {uid for _, uid in self.made}
        dirs = [workdir for workdir, _ in self.made]

        def ours(p: psutil.Process) -> bool:
            line = " ".join(p.info["cmdline"] or [])
            return p.info["uids"].real in uids or (
                "sandbox_launcher.py" in line and any(d in line for d in dirs))

        return [p for p in psutil.process_iter(["uids", "cmdline"]) if ours(p)]


@pytest.fixture
def clean(monkeypatch):
    """Asserts after the test: none of its sandbox runs left a process or a work dir."""
    runs, prepare = _Runs(), sandbox._prepare_workdir

    def recorded(files, uid):
        workdir = prepare(files, uid)
        runs.made.append((workdir, uid))
        return workdir

    monkeypatch.setattr(sandbox, "_prepare_workdir", recorded)
    yield runs
    assert runs.made, "the test ran no sandbox in this process: nothing was checked"
    assert runs.procs() == []
    assert [d for d, _ in runs.made if os.path.exists(d)] == []


def _scores_zero(code: str, tests: dict = ADD, limit: float = LIMIT_S) -> None:
    """Scores 0 within the runs' wall backstop: a program that hogs the cores alongside its
    forks gets little CPU time each second, so its CPU limit may come late."""
    start = time.monotonic()
    assert code_reward(_fence(code), tests, timeout_s=limit) == 0.0
    backstop = SandboxLimits.cpu_bound(limit).wall_s
    assert time.monotonic() - start < backstop * len(tests.get("inputs", [0, 0, 0])) + SLACK_S


def test_correct_program_passes(clean):
    """Positive control for the attacks below: the same tests do pass an honest program."""
    assert code_reward(_fence(ADD_OK), ADD) == 1.0
    assert code_reward(_fence("def add(a, b):\n    return a + b"), HUMANEVAL) == 1.0


def test_process_limit_then_fork_bomb(clean):
    # First prove RLIMIT_NPROC holds although we run as root ...
    counter = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               "            time.sleep(3)\n            os._exit(0)\n        n += 1\n"
               "except OSError:\n    print(n)\n")
    res = run_python(SandboxJob({"main.py": counter}, "main.py",
                                limits=SandboxLimits(wall_s=LIMIT_S, max_processes=8)))
    assert res.returncode == 0 and 1 <= int(res.stdout) < 8, res
    assert clean.procs() == []  # the sleeping children died with the run
    # ... only then run a fork bomb that survives fork failures.
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    _scores_zero(bomb, limit=0.5)  # its forks share the cores: the wall backstop decides
    assert psutil.Process().is_running()


def test_infinite_loop(clean):
    _scores_zero("while True:\n    pass\n")
    start = time.monotonic()  # a program that never reads a large stdin cannot stall the parent
    res = run_python(SandboxJob({"main.py": "while True:\n    pass\n"}, "main.py", stdin=b"7" * (8 << 20),
                                limits=SandboxLimits(wall_s=LIMIT_S)))
    assert res.timed_out and time.monotonic() - start < LIMIT_S + SLACK_S


def test_verdict_does_not_change_under_load(clean):
    """A program that needs 0.4 s of CPU passes a 1 s limit while three busy processes share
    its core, so its wall time is well over 1 s: the verdict is CPU time (issue 55). With the
    wall clock as the verdict (``SandboxLimits(wall_s=1.0)``) the same run fails (seen)."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\n"
    core, cores = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    hog = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    # each in a session of its own, as the sandbox's run is: the scheduler shares a core
    # fairly between sessions (autogroups), not between processes
    hogs = [subprocess.Popen([sys.executable, "-c", hog], start_new_session=True) for _ in range(3)]
    os.sched_setaffinity(0, {core})  # this thread's; the pool's thread and its runs inherit it
    try:
        with sandbox.SandboxPool(1) as pool:
            start = time.monotonic()
            assert code_reward(_fence(busy + ADD_OK), ADD, timeout_s=1.0, pool=pool) == 1.0
            assert time.monotonic() - start > 2 * 1.0  # two runs, each over 1 s of wall time
    finally:
        os.sched_setaffinity(0, cores)
        for p in hogs:
            p.kill()
            p.wait()


def test_memory_bomb(clean):
    _scores_zero("x = [0] * (1 << 31)\n" + ADD_OK)
    _scores_zero("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 26))\n")


def test_huge_output_is_capped(clean):
    start = time.monotonic()
    res = run_python(SandboxJob({"main.py": "while True:\n    print('x' * 10000)\n"}, "main.py",
                                limits=SandboxLimits(wall_s=LIMIT_S, output_bytes=1 << 16)))
    assert res.output_exceeded and len(res.stdout) <= 1 << 16
    assert time.monotonic() - start < LIMIT_S + SLACK_S
    _scores_zero("while True:\n    print('5\\n30' * 10000)\n")


def test_writes_outside_its_dir_do_not_land(clean):
    marker = f"klear-escape-{secrets.token_hex(4)}"
    targets = [f"/root/{marker}", f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}",
               os.path.expanduser(f"~/{marker}"), os.path.join(os.getcwd(), marker)]
    code = (f"import os\nhits = 0\nfor p in {targets!r} + [os.path.expanduser('~/{marker}')]:\n"
            "    try:\n        open(p, 'w').write('x')\n        hits += p.startswith('/root')\n"
            "    except OSError:\n        pass\n"
            "if hits:\n" + "    " + ADD_OK.replace("\n", "\n    "))
    _scores_zero(code)
    assert [t for t in targets if os.path.exists(t)] == []


def _serve_answers():
    class Handler(http.server.BaseHTTPRequestHandler):
        hits = 0

        def do_GET(self):  # noqa: N802 - http.server API
            Handler.hits += 1
            body = b"5"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, Handler


def test_no_network(clean):
    server, handler = _serve_answers()
    try:
        port = server.server_address[1]
        code = f"import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:{port}', timeout=1).read().decode())\n"
        # Negative control: outside the sandbox this program reaches the server.
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "5" and handler.hits == 1
        _scores_zero(code, {"inputs": [""], "outputs": ["5"]})
        assert handler.hits == 1
        # No route out either, checked without sending traffic: only "lo" exists inside.
        ifaces = ("import socket\nup = [n for _, n in socket.if_nameindex() if n != 'lo']\n"
                  "print(5 if up else 0)\n")
        outside = subprocess.run([sys.executable, "-c", ifaces], capture_output=True, text=True,
                                 timeout=30)
        assert outside.stdout.strip() == "5"  # negative control: the host has interfaces
        _scores_zero(ifaces, {"inputs": [""], "outputs": ["5"]})
    finally:
        server.shutdown()


def test_cannot_kill_the_parent_or_siblings(clean):
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (f"import os, signal\nkilled = 0\nfor pid in ({os.getpid()}, {sibling.pid}, -1, 1):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n        killed += pid > 1\n"
                "    except OSError:\n        pass\nif killed:\n    print(5)\n")
        _scores_zero(code, {"inputs": [""], "outputs": ["5"]})
        assert sibling.poll() is None
    finally:
        sibling.kill()
        sibling.wait()


@pytest.fixture
def outside_victim():
    """A file outside /tmp that the sandbox can see (root-owned, in the tests dir)."""
    path = os.path.join(os.path.dirname(__file__), f".victim-{secrets.token_hex(4)}")
    with open(path, "w") as f:
        f.write("keep me")
    yield path
    os.remove(path)


def test_cannot_delete_files(clean, tmp_path, outside_victim):
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "data.txt").write_text("keep me")
    repo_victim = outside_victim
    code = (f"import os, shutil\ngone = 0\nfor p in [{str(victim_dir / 'data.txt')!r}, {repo_victim!r}]:\n"
            "    try:\n        os.remove(p)\n        gone += 1\n    except OSError:\n        pass\n"
            f"shutil.rmtree({str(victim_dir)!r}, ignore_errors=True)\nif gone:\n    print(5)\n")
    _scores_zero(code, {"inputs": [""], "outputs": ["5"]})
    assert (victim_dir / "data.txt").read_text() == "keep me"
    assert open(repo_victim).read() == "keep me"


def _naive_humaneval_passes(solution: str, tests: dict, cwd: str) -> bool:
    """The textbook harness (exec solution + test + check, judge by exit code): the
    negative control showing that an attack fools a harness that trusts the process."""
    prog = f"{solution}\n{tests['test']}\ncheck({tests['entry_point']})\n"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, timeout=30,
                          cwd=cwd).returncode == 0


@pytest.mark.parametrize("solution", [
    "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b + 1",
    "import os\nos._exit(0)\ndef add(a, b):\n    return 0",
    "class Always:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
    "def add(a, b):\n    return Always()",
    "import builtins\nclass Never(Exception):\n    pass\nbuiltins.AssertionError = Never\n"
    "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return -1",
    "import json\nprint('All tests passed')\nopen('klear_result.json', 'w').write(json.dumps("
    "{'verdicts': [True, True], 'calls': [[['(1, 2)', '{}', 'ok', '3']], [['(5, 5)', '{}', 'ok', '10']]]}))\n"
    "def add(a, b):\n    raise SystemExit(0)",
], ids=["sys_exit", "os_exit", "eq_override", "builtins_override", "forged_report"])
def test_cannot_fake_verdicts(clean, solution, tmp_path):
    assert _naive_humaneval_passes(solution, HUMANEVAL, str(tmp_path))
    _scores_zero(solution, HUMANEVAL)


def test_forged_stdout_report(clean):
    _scores_zero("import json\nprint('All 2 tests passed')\nprint(json.dumps({'passed': 2, 'total': 2}))")


def test_environment_is_an_allow_list(clean, monkeypatch):
    monkeypatch.setenv("KLEAR_TEST_SECRET", "hunter2")
    res = run_python(SandboxJob({"main.py": "import json, os\nprint(json.dumps(dict(os.environ)))"},
                                "main.py"))
    env = json.loads(res.stdout)
    assert set(env) <= set(SANDBOX_ENV) | {"LC_CTYPE"}
    assert "hunter2" not in res.stdout.decode()


def test_works_from_a_venv_under_tmp(tmp_path):
    """The sandbox hides /tmp; a caller whose venv lives there must still run programs."""
    import site

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from megatron_klear.rewards.sandbox import SandboxJob, run_python\n"
            "r = run_python(SandboxJob({'main.py': 'print(6 * 7)'}, 'main.py'))\n"
            "print(r.returncode, r.stdout.decode().strip())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, *site.getsitepackages()]))
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, env=env, timeout=60)
    assert str(tmp_path).startswith("/tmp") and out.stdout.split() == ["0", "42"], out.stderr
