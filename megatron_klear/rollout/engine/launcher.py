"""Start (and always stop) rollout servers: embedded CPU servers, SGLang servers, or given URLs.

Every started server runs in its own process group and is stopped when the
:class:`RolloutServers` context exits, at interpreter exit (atexit), and -- on Linux -- when
the parent process dies abruptly (``PR_SET_PDEATHSIG``), so no server outlives the trainer.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from megatron_klear.distributed import free_port
from megatron_klear.orphans import die_with_parent

__all__ = ["RolloutServers", "LaunchError", "launch_embedded_servers", "launch_sglang_servers",
           "sglang_server_command", "router_command", "connect", "wait_healthy",
           "embedded_server_layout",
           "SGLANG_CPU_ARGS", "sglang_cpu_env", "server_env"]

# Real SGLang 0.5.23 on a CPU (the .venv-sglang of tools/setup_sglang_cpu.sh): the engine flags
# and environment that serve a tiny Qwen3 there (tests/interop/, quickstart --sglang).
# --sleep-on-idle: without it each idle scheduler busy-polls a full core
# (sglang/srt/managers/scheduler.py, IdleSleeper), starving every other process on 2 cores.
SGLANG_CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native",
                   "--disable-cuda-graph", "--disable-overlap-schedule",
                   "--max-total-tokens", "8192", "--sleep-on-idle"]


def sglang_cpu_env(tp: int = 1) -> dict[str, str]:
    """The environment of a CPU SGLang server: the CPU engine, and for ``tp`` > 1 one core set
    per TP rank (SGLang otherwise allows at most one rank per NUMA node,
    sglang/srt/utils/numa_utils.py)."""
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if tp > 1:
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // tp)
        sets = [cores[(r * per) % len(cores):(r * per) % len(cores) + per] for r in range(tp)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in sets)
    return env

# Set by torchrun for its workers; a server started from a trainer rank must not inherit them
# (with TORCHELASTIC_USE_AGENT_STORE=True, SGLang's own TP rendezvous would dial the agent).
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def server_env(**overrides: str) -> dict[str, str]:
    """This process's environment without torchrun's variables, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(overrides)
    return env


class LaunchError(RuntimeError):
    """A server did not start; the message names its URL, command and log file."""


class RolloutServers:
    """Handles of running servers: ``.urls``; ``.stop()`` (also on ``with`` exit and atexit)."""

    def __init__(self, urls: list[str], procs: list[subprocess.Popen] | None = None,
                 logs: list[IO] | None = None) -> None:
        self.urls = urls
        self.router_url: str | None = None
        self.procs = procs or []
        self._logs = logs or []
        if self.procs:
            atexit.register(self.stop)

    def __enter__(self) -> "RolloutServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after ``timeout_s``."""
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for f in self._logs:
            f.close()
        self.procs, self._logs = [], []


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float,
                 log_path: str | None = None) -> None:
    """Poll ``url``/health until 200; raise :class:`LaunchError` on exit of ``proc`` or timeout."""
    deadline = time.monotonic() + timeout_s
    where = f" (log: {log_path})" if log_path else ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"server {url} exited with code {proc.returncode} during "
                              f"startup{where}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"server {url} not healthy after {timeout_s:.0f}s{where}")


def _start(commands: list[list[str]], urls: list[str], log_dir: str | Path | None,
           startup_timeout_s: float, envs: list[dict] | None = None) -> RolloutServers:
    """Start each command in its own session (one per URL) and wait until all are healthy."""
    procs, logs, paths = [], [], []
    for i, (cmd, env) in enumerate(zip(commands, envs or [server_env()] * len(commands))):
        path = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            path = str(Path(log_dir) / f"server_{i}.log")
        out = open(path, "w") if path else subprocess.DEVNULL  # noqa: SIM115 - closed on stop
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=die_with_parent,
                                      env=env))
        logs += [out] if path else []
        paths.append(path)
    servers = RolloutServers(urls, procs, logs)
    try:
        for url, proc, path in zip(urls, procs, paths):
            wait_healthy(url, proc, startup_timeout_s, path)
    except BaseException:
        servers.stop()
        raise
    return servers


MAX_DEFAULT_EMBEDDED_SERVERS = 4


def embedded_server_layout(num_servers: int | None = None, cores: int | None = None
                           ) -> tuple[int, int]:
    """(servers, decode threads each) of embedded CPU servers that share ``cores`` (default:
    this process's): ``num_servers``, else one per core up to 4, the cores split evenly.

    Servers split each rollout's prompts, so each core decodes its own rows without the
    per-op thread synchronisation that one multi-threaded server pays on the small ops of a
    decode step (measured: docs/training.md, bench_rl_step)."""
    cores = cores or len(os.sched_getaffinity(0))
    servers = num_servers or min(cores, MAX_DEFAULT_EMBEDDED_SERVERS)
    return servers, max(1, cores // servers)


def launch_embedded_servers(model_dir: str | Path, num_servers: int = 1, *,
                            host: str = "127.0.0.1", base_port: int | None = None, seed: int = 0,
                            log_dir: str | Path | None = None, dtype: str = "float32",
                            load_format: str = "auto", num_threads: int = 1,
                            return_routed_experts: bool = False, batch_invariant: bool = False,
                            on_policy: bool = False,
                            startup_timeout_s: float = 120.0) -> RolloutServers:
    """Start ``num_servers`` embedded CPU servers (server i gets seed + i) and wait for /health.

    They run with ``--enable-deterministic-inference``: seeded requests are reproducible;
    with ``return_routed_experts`` (``--use-routing-replay``) also with
    ``--enable-return-routed-experts``; with ``batch_invariant`` (``--deterministic-rollout``)
    also with ``--enable-batch-invariant``; with ``on_policy`` (``--true-on-policy-mode``)
    also with ``--rl-on-policy-target megatron``. Server i plays an engine on GPU i
    (``CUDA_VISIBLE_DEVICES=i``, as :func:`launch_sglang_servers` places TP-1 engines): a
    colocated trainer's tensor handles of another GPU are refused there, as SGLang refuses them.
    """
    if not (Path(model_dir) / "config.json").is_file():
        raise LaunchError(f"--model {model_dir}: no config.json; pass an HF Qwen3 directory")
    ports = [base_port + i if base_port else free_port(host) for i in range(num_servers)]
    commands = [[sys.executable, "-m", "megatron_klear.rollout.engine.server",
                 "--model", str(model_dir),
                 "--host", host, "--port", str(port), "--seed", str(seed + i), "--dtype", dtype,
                 "--load-format", load_format, "--num-threads", str(num_threads),
                 "--enable-deterministic-inference"]
                + (["--enable-return-routed-experts"] if return_routed_experts else [])
                + (["--enable-batch-invariant"] if batch_invariant else [])
                + (["--rl-on-policy-target", "megatron"] if on_policy else [])
                for i, port in enumerate(ports)]
    envs = [server_env(OMP_NUM_THREADS=str(num_threads), CUDA_VISIBLE_DEVICES=str(i))
            for i in range(num_servers)]
    return _start(commands, [f"http://{host}:{p}" for p in ports], log_dir, startup_timeout_s,
                  envs)


def sglang_server_command(model_dir: str | Path, port: int, *, host: str = "127.0.0.1",
                          tp: int = 1, mem_fraction: float = 0.8,
                          context_length: int | None = None, yarn_factor: float | None = None,
                          original_max_position_embeddings: int = 32768,
                          extra_args: list[str] | None = None,
                          python: str | None = None) -> list[str]:
    """The ``python -m sglang.launch_server`` command line of one server (``python``: the
    interpreter that has SGLang, e.g. .venv-sglang/bin/python; default this one)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
           "--host", host, "--port", str(port), "--tp-size", str(tp),
           "--mem-fraction-static", str(mem_fraction), "--trust-remote-code"]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if yarn_factor is not None:
        rope = {"rope_type": "yarn", "factor": float(yarn_factor),
                "original_max_position_embeddings": int(original_max_position_embeddings)}
        cmd += ["--json-model-override-args", json.dumps({"rope_scaling": rope})]
    return cmd + list(extra_args or [])


def _require_module(module: str, pip_name: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise LaunchError(f"{module} is not installed in {sys.executable}; install it with "
                          f"`pip install {pip_name}` (GPU machines) or use the embedded "
                          "servers (launch_embedded_servers) on CPU")


def launch_sglang_servers(model_dir: str | Path, num_servers: int, *, tp: int = 1,
                          mem_fraction: float = 0.8, context_length: int | None = None,
                          yarn_factor: float | None = None, router: bool = False,
                          host: str = "127.0.0.1", base_port: int | None = None,
                          log_dir: str | Path | None = None, startup_timeout_s: float = 900.0,
                          extra_args: list[str] | None = None, python: str | None = None,
                          env: dict[str, str] | None = None,
                          return_routed_experts: bool = False) -> RolloutServers:
    """Start SGLang servers (server i on GPUs [i*tp, (i+1)*tp)) and optionally the router.

    ``return_routed_experts`` (``--use-routing-replay``): start them with
    ``--enable-return-routed-experts``, without which SGLang returns no experts.

    ``urls`` are the servers' URLs (weight updates go to each server directly); with
    ``router=True`` the router runs too and ``router_url`` is where to send generations.
    ``python`` runs SGLang from another environment (its own check); ``env`` adds variables,
    e.g. ``sglang_cpu_env(tp)`` with ``extra_args=SGLANG_CPU_ARGS`` on a CPU.
    """
    if python is None:
        _require_module("sglang", "'sglang[all]>=0.5'")
    if router:
        _require_module("sglang_router", "sglang-router")
    ports = [base_port + i if base_port else free_port(host) for i in range(num_servers)]
    urls = [f"http://{host}:{p}" for p in ports]
    extra_args = list(extra_args or []) + (["--enable-return-routed-experts"]
                                           if return_routed_experts else [])
    commands = [sglang_server_command(model_dir, p, host=host, tp=tp, mem_fraction=mem_fraction,
                                      context_length=context_length, yarn_factor=yarn_factor,
                                      extra_args=extra_args, python=python) for p in ports]
    envs = [server_env(CUDA_VISIBLE_DEVICES=",".join(str(i * tp + j) for j in range(tp)),
                       **(env or {})) for i in range(num_servers)]
    if router:
        rport = free_port(host)
        commands.append(router_command(urls, rport, host=host))
        envs.append(server_env())
        urls.append(f"http://{host}:{rport}")
    servers = _start(commands, urls, log_dir, startup_timeout_s, envs)
    servers.router_url = urls.pop() if router else None
    return servers


def router_command(worker_urls: list[str], port: int, *, host: str = "127.0.0.1") -> list[str]:
    """The ``python -m sglang_router.launch_router`` command line."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port",
            str(port), "--worker-urls", *worker_urls]


def connect(urls: list[str], *, timeout_s: float = 30.0) -> RolloutServers:
    """Servers started elsewhere: check each answers /health, never stop them."""
    urls = [u.rstrip("/") for u in urls]
    for url in urls:
        wait_healthy(url, None, timeout_s)
    return RolloutServers(urls)
