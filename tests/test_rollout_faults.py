"""Fault behaviour of the rollout client and launcher with real server processes.

A server killed (SIGKILL) with requests in flight, all servers down, a hung server, and
servers that must not outlive their parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from megatron_klear.rollout.client import RolloutClient, RolloutError, SamplingParams
from megatron_klear.rollout.launcher import (LaunchError, free_port, launch_embedded_servers,
                                             launch_sglang_servers, sglang_server_command)
from tests.rollout_helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_killed_server_requests_retried_on_survivor(model_dir):
    """SIGKILL a server holding in-flight requests: every prompt is still answered."""
    with launch_embedded_servers(model_dir, 2) as servers:
        victim, survivor = servers.urls
        client = RolloutClient(servers.urls, request_timeout_s=60, max_retries=3, backoff_s=0.1)
        # the victim holds its requests (paused in place) so they are in flight when it dies
        RolloutClient([victim]).post_all("/pause_generation", {"mode": "in_place"})
        prompts = [f"prompt {i}" for i in range(8)]
        result: list = []
        worker = threading.Thread(target=lambda: result.append(
            client.generate(prompts, SamplingParams(max_new_tokens=6, n=2))))
        worker.start()
        time.sleep(1.5)
        assert client.servers[0].outstanding > 0, "no request was in flight on the victim"
        os.killpg(servers.procs[0].pid, signal.SIGKILL)
        worker.join(timeout=60)
        assert not worker.is_alive(), "generate hung after a server died"
        assert len(result[0]) == len(prompts)
        assert all(len(gens) == 2 and all(g.finish_reason in ("stop", "length") for g in gens)
                   for gens in result[0])
        assert client.servers[0].last_error and not _alive(victim) and _alive(survivor)


def test_all_servers_down_fails_fast_naming_urls():
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    client = RolloutClient(urls, request_timeout_s=5, max_retries=2, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(RolloutError) as err:
        client.generate(["a", "b"], SamplingParams(max_new_tokens=2))
    assert time.monotonic() - start < 5
    assert all(u in str(err.value) for u in urls)


def test_hung_server_times_out_with_clear_error(model_dir):
    """A server that never answers costs at most (retries + 1) x request timeout."""
    with launch_embedded_servers(model_dir, 1) as servers:
        RolloutClient(servers.urls).post_all("/pause_generation", {"mode": "in_place"})
        client = RolloutClient(servers.urls, request_timeout_s=1.0, max_retries=1, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(RolloutError, match="TimeoutError") as err:
            client.generate(["a"], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - start < 4
        assert servers.urls[0] in str(err.value)
        procs = list(servers.procs)
    assert all(p.poll() is not None for p in procs), "a server outlived the context manager"


def test_servers_die_with_crashed_parent(model_dir, tmp_path):
    """A parent killed by SIGKILL (no atexit) takes its servers down too."""
    script = textwrap.dedent(f"""
        import sys, time
        from megatron_klear.rollout.launcher import launch_embedded_servers
        s = launch_embedded_servers({str(model_dir)!r}, 1)
        print(s.urls[0], flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        url = parent.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and _alive(url)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while _alive(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(url), "the server outlived its killed parent"


def test_embedded_launcher_rejects_missing_model(tmp_path):
    with pytest.raises(LaunchError, match="config.json"):
        launch_embedded_servers(tmp_path, 1)


def test_sglang_command_line():
    cmd = sglang_server_command("/models/q", 30000, tp=2, mem_fraction=0.7, context_length=32768,
                                yarn_factor=4.0)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--model-path") == "/models/q" and flag("--port") == "30000"
    assert flag("--tp-size") == "2" and flag("--mem-fraction-static") == "0.7"
    assert flag("--context-length") == "32768"
    assert '"rope_type": "yarn"' in cmd[-1] and '"factor": 4.0' in cmd[-1]
    assert "--json-model-override-args" not in sglang_server_command("/m", 1)


def test_sglang_missing_is_a_clear_error(tmp_path):
    with pytest.raises(LaunchError, match="pip install 'sglang"):
        launch_sglang_servers(tmp_path, 1)
