"""The remote reward service (--reward-url) against a real local HTTP server, and DAPO's
overlong shaping against hand values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_klear.rewards.remote import RemoteReward, RewardServiceError
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.distributed import free_port
from megatron_klear.train.metrics import read_metrics
from tests.reward_plugins import parity_reward


class RewardService:
    """A real HTTP reward service on loopback that scores with ``parity_reward``; ``fail``
    makes the next N requests answer 503, ``delay`` sleeps before answering, ``dead_after``
    answers 500 to every request after that many."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail = 0
        self.delay = 0.0
        self.dead_after: int | None = None
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                time.sleep(service.delay)
                dead = service.dead_after is not None and \
                    len(service.requests) > service.dead_after
                if service.fail or dead:
                    service.fail = max(service.fail - 1, 0)
                    self.send_response(500 if dead else 503)
                    self.end_headers()
                    return
                rewards = [parity_reward(r, lab) for r, lab in
                           zip(body["responses"], body["labels"])]
                out = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    s = RewardService()
    yield s
    s.close()


def test_batches_in_order_and_retries_503(service):
    service.fail = 2  # two 503s, then answers: retried with back-off
    remote = RemoteReward(service.url, timeout=5, retries=2, batch_size=2)
    responses = ["ab", "abc", "abcd", "a", "never-even"]
    labels = ["x", "x", "x", "x", "never"]
    got = remote.score([f"p{i}" for i in range(5)], responses, labels)
    assert got == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [len(r["responses"]) for r in service.requests] == [2, 2, 2, 2, 1]  # 2 retried
    assert service.requests[-1] == {"prompts": ["p4"], "responses": ["never-even"],
                                    "labels": ["never"]}


@pytest.mark.parametrize("fault", ["slow", "dead", "down"])
def test_unanswered_batch_fails_naming_the_service(service, fault):
    url = service.url
    if fault == "slow":
        service.delay = 1.0
    elif fault == "dead":
        service.dead_after = 0
    else:
        url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    remote = RemoteReward(url, timeout=0.3, retries=1)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError, match=r"--reward-url.*2 tries.*rerun"):
        remote.score(["p"], ["ab"], ["x"])
    assert time.monotonic() - t0 < 5  # bounded by timeout x tries + back-off


def test_malformed_answer_fails_at_once(service):
    remote = RemoteReward(service.url, timeout=5, retries=3)
    with pytest.raises(RewardServiceError, match="answered 1 rewards for 2 responses"):
        remote._rewards(b'{"rewards": [1.0]}', 2)
    with pytest.raises(RewardServiceError, match="expected a JSON body"):
        remote._rewards(b"<html>", 1)


def test_overlong_shaping_hand_values():
    shaping = OverlongShaping(max_len=20, buffer_len=8, factor=1.0)
    # expected length 12: nothing up to 12 tokens, then -1/8 per token down to -1 at 20
    assert [shaping.penalty(n) for n in (0, 12, 13, 16, 20)] == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert OverlongShaping(20, 4, 0.5).penalty(18) == -0.25
    with pytest.raises(ValueError, match="--overlong-buffer-len"):
        OverlongShaping(20, 21)


def _rl(hf, data, save, *extra):
    return [sys.executable, "-m", "megatron_klear.train.rl", "--hf-checkpoint", str(hf),
            "--prompt-data", str(data), "--save", str(save), "--rollout-batch-size", "4",
            "--mini-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "8",
            "--rollout-max-response-len", "8", "--no-dynamic-sampling", "--train-iters", "2",
            "--seed", "3", "--no-progress-bar", "--save-interval", "1", "--no-probe-weights",
            *extra]


def test_rl_with_service_fails_cleanly_then_resumes(service, tmp_path):
    """klear-rl scores through the service; when it dies after step 1 the step fails with its
    message and the rerun resumes at step 2 with the same prompts; shaped rewards enter the
    metrics."""
    from tests.rollout_helpers import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                            for i in range(8)))
    save = tmp_path / "ck"
    cmd = _rl(hf, data, save, "--reward-url", service.url, "--reward-timeout", "5",
              "--reward-retries", "1", "--overlong-buffer-len", "4")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    service.dead_after = 1  # step 1's batch is scored, step 2's is not
    failed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert failed.returncode != 0
    assert "(--reward-url) could not score the batch" in failed.stdout + failed.stderr
    assert [m["step"] for m in read_metrics(save / "metrics.jsonl")] == [1]

    service.dead_after = None
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300)
    hist = read_metrics(save / "metrics.jsonl")
    assert [m["step"] for m in hist] == [1, 2]
    assert [m["data/consumed_prompts"] for m in hist] == [4, 8]
    # step 1; step 2 tried twice (--reward-retries 1) and failed; step 2 in the rerun
    assert len(service.requests) == 4 and all(len(r["responses"]) == 16
                                              for r in service.requests)
    assert service.requests[1]["prompts"] == service.requests[3]["prompts"]  # same prompts
    for m in hist:  # 8-token responses with a 4-token buffer: penalised when long
        assert -1.0 <= m["rollout/overlong_penalty"] <= 0.0
