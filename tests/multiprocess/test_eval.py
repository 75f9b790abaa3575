"""klear-eval: numbers equal a hand computation from the samples, resume, rejudge, bad input."""

import json
import math
import subprocess
import sys
from collections import defaultdict

import pytest

from megatron_klear.eval.evaluate import parse_benchmark
from tests.kill_points import kill_when_logged

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
    kill_when_logged(proc, samples, 16 * K, timeout=120)
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


def test_eval_with_tools_scores_final_answers_and_reports_turn_metrics(tmp_path):
    """evaluate() with tools: each sample is a multi-turn trajectory of the real python tool
    (a scripted engine stands in for the servers); the math reward scores the final answer,
    a malformed call is a tool error, and the report's per-sample means are the records'."""
    from megatron_klear.eval.evaluate import Benchmark, evaluate
    from megatron_klear.rollout.orchestration.client import SamplingParams
    from tests.unit.test_multi_turn import ScriptedEngine, _ctx, _tokenizer, call

    tok, end = _tokenizer(), "<|im_end|>"
    engine = ScriptedEngine(tok, {
        "Six": [call("print(6 * 7)") + end, "So \\boxed{42}." + end],
        "Bad": ['<tool_call>\n{"name": "python", "arguments": \n</tool_call>' + end,
                call("print(1)") + end, "It is \\boxed{2}." + end]})
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"prompt": "Six times seven?", "answer": "42"}) + "\n" +
                     json.dumps({"prompt": "Bad one?", "answer": "3"}) + "\n")
    mt = _ctx(tok, engine, max_turns=3).multi_turn
    report = evaluate(engine, tok, [Benchmark("b", str(bench))], k=2,
                      params=SamplingParams(max_new_tokens=400), samples_path=tmp_path / "s",
                      progress=False, multi_turn=mt)["b"]
    recs = [json.loads(line) for line in (tmp_path / "s").read_text().splitlines()]
    got = {(r["problem"], r["score"], r["turns"], r["tool_calls"], r["tool_errors"],
            r["stop_reason"]) for r in recs}
    assert len(recs) == 4 and got == {(0, 1.0, 2, 1, 0, "answer"), (1, 0.0, 3, 2, 1, "answer")}
    six = next(r for r in recs if r["problem"] == 0)
    assert six["response"] == "So \\boxed{42}." and [m["role"] for m in six["messages"]] == \
        ["assistant", "tool", "assistant"] and six["messages"][1]["content"] == "42\n"
    assert all(r["model_tokens"] + r["tool_tokens"] == r["response_tokens"] and
               r["tool_tokens"] > 0 for r in recs)
    assert report["avg@2"] == 0.5 and report["mean_turns"] == 2.5
    assert report["tool_calls_per_sample"] == 1.5 and report["tool_errors_per_sample"] == 0.5
    assert report["turn_limit_rate"] == 0.0 and report["mean_tool_tokens"] == sum(
        r["tool_tokens"] for r in recs) / 4
    # at --max-turns 2 the bad problem's second call is not run: a turn-limit hit
    mt2 = _ctx(tok, engine, max_turns=2).multi_turn
    report = evaluate(engine, tok, [Benchmark("b", str(bench))], k=2,
                      params=SamplingParams(max_new_tokens=400), progress=False,
                      multi_turn=mt2)["b"]
    assert report["turn_limit_rate"] == 0.5 and report["tool_calls_per_sample"] == 1.0


def test_klear_eval_cli_with_tools(tmp_path, capsys):
    """klear-eval --tools (klear-rl's tool flags) against the embedded server: multi-turn
    trajectories of a user tool through a user parser (a random model writes no calls), each
    tool response answering the turn before it; scores, report means and bad flags."""
    from megatron_klear.eval.__main__ import build_parser, check_args, main
    from tests.multiprocess.test_multi_turn_server import HERE, long_context_model
    from tests.qwen3_files import qwen3_chat_template_file
    from tests.unit.test_multi_turn import PLAIN

    template = qwen3_chat_template_file(tmp_path)

    hf = long_context_model(tmp_path / "tiny")
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                             for i in range(3)))
    flags = ["--model", str(hf), "--benchmark", f"toy={bench}@{REWARD}", "--k", "2",
             "--max-new-tokens", "200", "--chat-template", str(template), "--seed", "1",
             "--tools", f"{HERE}:count", "--tool-parser", f"{HERE}:every_turn_calls",
             "--max-turns", "3", "--max-tool-response-tokens", "8", "--tool-timeout", "3",
             "--num-servers", "1", "--out-dir", str(tmp_path / "out")]
    main(flags)   # in this process (the server is one): a CLI's imports cost ~10 s a launch
    payload = json.loads((tmp_path / "out" / "report.json").read_text())
    report, recs = payload["benchmarks"]["toy"], [
        json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert payload["meta"]["tools"] == [f"{HERE}:count"] and len(recs) == 6
    for r in recs:
        msgs = r["messages"]
        assert [m["role"] for m in msgs[::2]] == ["assistant"] * r["turns"]
        assert r["response"] == [m for m in msgs if m["role"] == "assistant"][-1]["content"]
        for a, t in zip(msgs[::2], msgs[1::2]):   # each call answered: the turn's length,
            full = f"{len(a['content'])} characters"   # cut at 8 (one character a token)
            cut = full if len(full) <= 8 else full[:8] + f"\n[... {len(full) - 8} more tokens cut]"
            assert t == {"role": "tool", "content": cut}
        assert r["tool_calls"] == len(msgs[1::2]) and r["tool_errors"] == 0
        assert r["tool_calls"] == r["turns"] - (r["stop_reason"] in ("max_turns", "length"))
        assert r["score"] == float(len(r["response"]) % 2 == 0)
        assert r["model_tokens"] + r["tool_tokens"] == r["response_tokens"] <= 200
    assert sum(r["turns"] for r in recs) > len(recs)        # several turns were taken
    for key, field in [("mean_turns", "turns"), ("tool_calls_per_sample", "tool_calls"),
                       ("mean_tool_tokens", "tool_tokens")]:
        assert report[key] == pytest.approx(sum(r[field] for r in recs) / 6)
    assert report["turn_limit_rate"] == pytest.approx(
        sum(r["stop_reason"] == "max_turns" for r in recs) / 6)
    assert report["avg@2"] == pytest.approx(sum(r["score"] for r in recs) / 6)
    # bad tool flags: refused by name before anything is built
    from megatron_klear.config import ConfigError
    for extra, msg in [(["--tools", "nope:fn"], "--tools nope:fn"),
                       (["--tools", "python", "--max-turns", "0"], "--max-turns"),
                       (["--tools", "python", "--tool-parser", "nope"], "--tool-parser"),
                       (["--tools", "python", "--prompt-template", "raw"], "drop --prompt")]:
        with pytest.raises(ConfigError, match=msg):
            check_args(build_parser().parse_args(flags[:4] + extra))
    # a chat template without tool support: one line, exit 2, before any server starts
    at = flags.index("--chat-template") + 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(flags[:at] + [str(PLAIN)] + flags[at + 1:])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error: --tools: the chat template")
    assert "\n" not in err
