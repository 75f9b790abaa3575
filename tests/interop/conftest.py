"""Real SGLang 0.5.23 servers on this CPU for the interop tier (tests/interop/).

The servers run from .venv-sglang (tools/setup_sglang_cpu.sh; .ci/run builds it before
pytest). Where that venv is missing, it is built here; only where it cannot be built does the
tier skip, with the reason. Servers are module-scoped: a start costs 45-60 s (more on a busy
machine), so every test of a module shares them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_klear.rollout.engine.launcher import (SGLANG_CPU_ARGS, LaunchError,
                                                    launch_sglang_servers, sglang_cpu_env)
from tests.rollout_helpers import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
STARTUP_S = 300.0  # below the tests' 600 s pytest timeout, so a stuck start fails with its log
# fp32 like the trainer's reference (SGLang's --dtype auto serves an fp32 checkpoint in bf16)
MODEL_ARGS = ["--dtype", "float32"]


def _ensure_venv() -> None:
    if (ROOT / ".venv-sglang" / ".klear-stamp").is_file() and SGLANG_PYTHON.is_file():
        return
    proc = subprocess.run(["bash", str(ROOT / "tools" / "setup_sglang_cpu.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.skip("real SGLang cannot be installed here (tools/setup_sglang_cpu.sh failed): "
                    + (proc.stderr or proc.stdout)[-800:])


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> Path:
    """The tiny Qwen3 (fp32, random weights, character tokenizer) the servers load."""
    _ensure_venv()
    return make_tiny_model(tmp_path_factory.mktemp("sglang_model"))


def start_sglang(model_dir: Path, num_servers: int, log_dir: Path, tp: int = 1,
                 base_port: int | None = None):
    """Real SGLang servers on 127.0.0.1 with the CPU engine flags (``base_port``: restart a
    server on the port it had)."""
    try:
        return launch_sglang_servers(model_dir, num_servers, tp=tp, log_dir=log_dir,
                                     base_port=base_port,
                                     startup_timeout_s=STARTUP_S, python=str(SGLANG_PYTHON),
                                     env=sglang_cpu_env(tp),
                                     extra_args=SGLANG_CPU_ARGS + MODEL_ARGS)
    except LaunchError as exc:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(Path(log_dir).glob("*.log")))
        raise AssertionError(f"{exc}\n{logs}") from exc
