"""Multi-turn tool rollouts against real SGLang 0.5.23 on CPU (issue 40): over several turns
the Sample's ids and rollout log-probs are SGLang's replies bit for bit, each turn's request
is the Sample's exact ids (input_ids), and transformers agrees at the model's tokens. The
same check as tests/multiprocess/test_multi_turn_server.py runs against the embedded server."""

from __future__ import annotations

from tests.interop.conftest import start_sglang
from tests.multiprocess.test_multi_turn_server import check_engine_trajectories, long_context_model


def test_multi_turn_ids_and_logprobs_are_sglangs(sglang_model, tmp_path):
    model_dir = long_context_model(tmp_path / "tiny")   # sglang_model: the venv is built
    with start_sglang(model_dir, 1, tmp_path / "logs") as servers:
        check_engine_trajectories(model_dir, servers.urls, 1.0, 1e-3)
