"""klear-eval: numbers equal a hand computation from the samples, resume, rejudge, bad input."""

import json
import math
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from megatron_klear.eval.evaluate import parse_benchmark

REWARD = "tests.reward_plugins:parity_reward"
K = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("eval")
    hf = save_tiny_hf_model(root / "hf", seed=0)
    bench = root / "bench.jsonl"
    rows = [{"prompt": f"Count to {i}.", "answer": "never" if i % 3 == 0 else "x"}
            for i in range(40)]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, hf, bench


def _cli(hf, bench, out, *extra):
    return [sys.executable, "-m", "megatron_klear.eval", "--model", str(hf), "--benchmark",
            f"toy={bench}@{REWARD}", "--k", str(K), "--max-new-tokens", "8", "--out-dir",
            str(out), "--seed", "4", *extra]


def _pass_at_k(n, c, k):  # the unbiased estimator, written out independently
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


@pytest.fixture(scope="module")
def full_run(setup):
    root, hf, bench = setup
    out = root / "full"
    subprocess.run(_cli(hf, bench, out), check=True, capture_output=True)
    return out


def test_report_equals_hand_computation_and_rejudge(setup, full_run):
    root, out = setup[0], full_run
    report = json.loads((out / "report.json").read_text())["benchmarks"]["toy"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_problem = defaultdict(list)
    for s in samples:
        assert s["score"] == (0.0 if s["label"] == "never" else float(len(s["response"]) % 2 == 0))
        by_problem[s["problem"]].append(s["score"])
    assert sorted(by_problem) == list(range(40)) and all(len(v) == K for v in by_problem.values())
    avg = sum(s["score"] for s in samples) / len(samples)
    pak = sum(_pass_at_k(K, sum(v >= 1 for v in vs), K) for vs in by_problem.values()) / 40
    assert 0 < avg < 1 and abs(report[f"avg@{K}"] - avg) < 1e-12
    assert abs(report[f"pass@{K}"] - pak) < 1e-12
    means = [sum(v) / K for v in by_problem.values()]  # SE over problems, by hand
    var = sum((m - sum(means) / 40) ** 2 for m in means) / 39
    assert report[f"avg@{K}_se"] > 0 and abs(report[f"avg@{K}_se"] - (var / 40) ** 0.5) < 1e-12
    assert report["samples"] == 40 * K and (out / "report.md").read_text().count("| toy |") == 1
    # re-judging the saved responses (no model) reproduces the scores
    rejudged = root / "rejudged"
    subprocess.run([sys.executable, "-m", "megatron_klear.eval", "--rejudge",
                    str(out / "samples.jsonl"), "--out-dir", str(rejudged)], check=True,
                   capture_output=True)
    again = json.loads((rejudged / "report.json").read_text())["benchmarks"]["toy"]
    assert again[f"avg@{K}"] == report[f"avg@{K}"] and again[f"pass@{K}"] == report[f"pass@{K}"]


def test_interrupted_eval_resumes(setup, full_run):
    root, hf, bench = setup
    out = root / "resumed"
    proc = subprocess.Popen(_cli(hf, bench, out),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = out / "samples.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if samples.exists() and samples.read_text().count("\n") >= 16 * K:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    first = samples.read_text().count("\n")
    assert 0 < first < 40 * K
    subprocess.run(_cli(hf, bench, out), check=True, capture_output=True)
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 40 * K  # finished problems were not redone
    full = json.loads((full_run / "report.json").read_text())["benchmarks"]["toy"]
    got = json.loads((out / "report.json").read_text())["benchmarks"]["toy"]
    assert got == full  # seeded sampling: the resumed report equals the uninterrupted one


def test_missing_field_names_the_line(setup, tmp_path):
    root, hf, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" +
                   json.dumps({"prompt": "b", "answer": "2"}) + "\n" + json.dumps({"prompt": "c"}))
    proc = subprocess.run([sys.executable, "-m", "megatron_klear.eval", "--model", str(hf),
                           "--benchmark", str(bad), "--out-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{bad}:3" in proc.stderr and "answer" in proc.stderr


def test_parse_benchmark_spec():
    b = parse_benchmark("lcb=/d/lcb.jsonl@code")
    assert (b.name, b.path, b.reward) == ("lcb", "/d/lcb.jsonl", "code")
    b = parse_benchmark(f"/d/aime24.jsonl@{REWARD}")
    assert (b.name, b.path, b.reward) == ("aime24", "/d/aime24.jsonl", REWARD)


def test_a_model_without_tokenizer_is_refused_by_name(tmp_path):
    """A dir with config.json but no tokenizer files (a checkpoint converted without
    --hf-config) made transformers build an empty tokenizer, every prompt encoding to no
    tokens; klear-eval then failed far away ("the prompt is empty"). Now it names the dir."""
    from megatron_klear.data.prompts import DataError, load_tokenizer
    from megatron_klear.eval.__main__ import resolve_model
    from megatron_klear.models.tiny import tiny_qwen3_config

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(tiny_qwen3_config()))
    with pytest.raises(DataError, match="bare: no tokenizer files"):
        load_tokenizer(bare)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(FileNotFoundError, match="add --hf-config"):
        resolve_model(str(ckpt), tmp_path / "out")


def test_paired_gain_is_the_mean_and_se_of_per_problem_differences(tmp_path):
    from megatron_klear.eval.evaluate import paired_gain

    def write(path, scores):  # problem -> its k scores, in klear-eval's samples.jsonl form
        path.write_text("".join(json.dumps({"benchmark": "b", "problem": p, "score": s}) + "\n"
                                for p, ss in scores.items() for s in ss)
                        + json.dumps({"benchmark": "other", "problem": 0, "score": 1.0}) + "\n")

    write(tmp_path / "before.jsonl", {0: [0, 0], 1: [1, 0], 2: [1, 1]})
    write(tmp_path / "after.jsonl", {0: [1, 1], 1: [1, 1], 2: [1, 1]})
    gain, se = paired_gain(tmp_path / "before.jsonl", tmp_path / "after.jsonl", "b")
    # differences 1, 0.5, 0: mean 0.5, sample std 0.5, SE 0.5 / sqrt(3)
    assert gain == 0.5 and abs(se - 0.5 / 3 ** 0.5) < 1e-12
    write(tmp_path / "short.jsonl", {0: [1, 1]})
    with pytest.raises(ValueError, match="different problems"):
        paired_gain(tmp_path / "before.jsonl", tmp_path / "short.jsonl", "b")
