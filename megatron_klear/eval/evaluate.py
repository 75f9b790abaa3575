"""avg@k evaluation through the rollout servers, with resumable per-sample records.

Every sampled response is appended to ``samples.jsonl`` (problem, response, score) as
soon as its problem is done, so an interrupted run resumes without regenerating, and a
report can be recomputed from the samples alone (re-judging).

With tools (``multi_turn``, klear-eval ``--tools``) each sample is a multi-turn tool
trajectory (rollout/orchestration/multi_turn.py, the generate stage klear-rl trains on); the reward scores
its final answer, the record keeps the conversation after the prompt and the turn counts, and
the report adds the per-sample means of calls, tool errors and turn-limit hits.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from megatron_klear.data.prompts import load_prompt_dataset, render_prompt
from megatron_klear.data.records_io import write_text
from megatron_klear.rewards import score_batch
from megatron_klear.rewards.metrics import pass_at_k
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig, generate_tool_turns
from megatron_klear.rollout.orchestration.pipeline import RolloutContext


@dataclass
class Benchmark:
    """A JSONL benchmark and how to read and score it."""

    name: str
    path: str
    reward: str = "math"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_format: str | None = None


def parse_benchmark(spec: str, **defaults: Any) -> Benchmark:
    """``[name=]path[@reward]``: name defaults to the file stem, reward to ``math``
    (``code``, or an import path ``pkg.module:function``)."""
    name, _, rest = spec.partition("=") if "=" in spec else ("", "", spec)
    path, _, reward = rest.partition("@")
    fields = dict(defaults)
    if reward:
        fields["reward"] = reward
    return Benchmark(name=name or Path(path).stem, path=path, **fields)


def _done(samples_path: Path) -> dict[tuple[str, int], list[dict]]:
    done: dict[tuple[str, int], list[dict]] = defaultdict(list)
    if samples_path.exists():
        for line in samples_path.read_text().splitlines():
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a torn last line from a kill
                    continue
                done[(rec["benchmark"], rec["problem"])].append(rec)
    return done


def evaluate(client: RolloutClient, tokenizer: Any, benchmarks: Sequence[Benchmark], *,
             k: int, params: SamplingParams, samples_path: str | Path | None = None,
             batch_problems: int = 16, progress: bool = True, seed: int = 0,
             multi_turn: MultiTurnConfig | None = None) -> dict[str, dict]:
    """Sample ``k`` responses per problem, score them, and return the report per benchmark.

    Problem i is sampled with ``sampling_seed`` derived from (seed, i): results do not
    depend on batching or on which server answers, so a resumed run matches a full one.
    ``multi_turn``: sample tool-using trajectories instead (``params.max_new_tokens`` is then
    each trajectory's budget of sampled + tool tokens, as klear-rl's).
    """
    samples_path = Path(samples_path) if samples_path else None
    done = _done(samples_path) if samples_path else {}
    if samples_path and any(len(recs) != k for recs in done.values()):
        done = {key: recs for key, recs in done.items() if len(recs) == k}  # drop partials
        write_text(samples_path, "".join(json.dumps(r) + "\n" for recs in done.values()
                                            for r in recs))
    params = SamplingParams(**{**params.__dict__, "n": k})
    records: list[dict] = [r for recs in done.values() for r in recs]
    for bench in benchmarks:
        problems = load_prompt_dataset(bench.path, prompt_key=bench.prompt_key,
                                       answer_key=bench.answer_key,
                                       answer_format=bench.answer_format)
        todo = [p for p in problems if len(done.get((bench.name, p.index), [])) != k]
        bar = tqdm(total=len(problems), initial=len(problems) - len(todo), desc=f"eval {bench.name}",
                   disable=not progress)
        for start in range(0, len(todo), batch_problems):
            chunk = todo[start:start + batch_problems]
            new = (_sample_tool_turns(client, tokenizer, bench, chunk, params, seed, multi_turn)
                   if multi_turn else
                   _sample_and_score(client, tokenizer, bench, chunk, params, seed))
            if samples_path:
                with samples_path.open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in new))
                    f.flush()
                    os.fsync(f.fileno())
            records += new
            bar.update(len(chunk))
        bar.close()
    return summarize(records, k)


def _problem_seeds(problems, seed: int) -> list[int]:
    return [(seed * 1_000_003 + p.index) % 2**31 for p in problems]


def _sample_and_score(client, tokenizer, bench: Benchmark, problems, params, seed: int
                      ) -> list[dict]:
    prompts = [tokenizer(render_prompt(tokenizer, p.messages), add_special_tokens=False)
               ["input_ids"] for p in problems]
    gens = client.generate(prompts, params, _problem_seeds(problems, seed))
    flat = [(p, g) for p, group in zip(problems, gens) for g in group]
    scores = score_batch(bench.reward, [g.text for _, g in flat], [p.label for p, _ in flat])
    return [{"benchmark": bench.name, "problem": p.index, "reward_name": bench.reward,
             "label": p.label, "response": g.text, "response_tokens": len(g.output_ids),
             "finish_reason": g.finish_reason, "score": float(s)}
            for (p, g), s in zip(flat, scores)]


def _sample_tool_turns(client, tokenizer, bench: Benchmark, problems, params, seed: int,
                       multi_turn: MultiTurnConfig) -> list[dict]:
    """k multi-turn tool trajectories per problem, their final answers scored by the
    benchmark's reward; each record adds the turns, calls, tool errors, why it stopped, the
    model's and the tools' token counts and the conversation after the prompt."""
    ctx = RolloutContext(client, tokenizer, params, bench.reward, 1.0, multi_turn=multi_turn)
    samples = generate_tool_turns(ctx, problems, _problem_seeds(problems, seed))
    scores = score_batch(bench.reward, [s.response_text for s in samples],
                         [s.label for s in samples])
    records = []
    for s, score in zip(samples, scores):
        t, model = s.trajectory, sum(s.loss_mask)
        records.append({
            "benchmark": bench.name, "problem": s.prompt_index, "reward_name": bench.reward,
            "label": s.label, "response": s.response_text,
            "response_tokens": len(s.response_ids), "finish_reason": s.finish_reason,
            "score": float(score), "turns": len(t.turn_spans), "tool_calls": t.calls,
            "tool_errors": t.tool_errors, "stop_reason": t.stop_reason,
            "model_tokens": model, "tool_tokens": len(s.response_ids) - model,
            "messages": t.messages[len(problems[s.group].messages):]})
    return records


# klear-eval's per-sample means of multi-turn records (report key: record field or test)
TOOL_METRICS = {"mean_turns": "turns", "tool_calls_per_sample": "tool_calls",
                "tool_errors_per_sample": "tool_errors",
                "turn_limit_rate": lambda r: r["stop_reason"] == "max_turns",
                "token_limit_rate": lambda r: r["stop_reason"] == "max_response_tokens",
                "mean_model_tokens": "model_tokens", "mean_tool_tokens": "tool_tokens"}


def summarize(records: Iterable[dict], k: int) -> dict[str, dict]:
    """avg@k, unbiased pass@k, mean response length and truncation rate per benchmark;
    for tool trajectories also :data:`TOOL_METRICS` (per-sample means)."""
    by_problem: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_problem[r["benchmark"]][r["problem"]].append(r)
    report = {}
    for bench, problems in sorted(by_problem.items()):
        samples = [r for rs in problems.values() for r in rs]
        correct = {p: sum(r["score"] >= 1.0 for r in rs) for p, rs in problems.items()}
        report[bench] = {
            "problems": len(problems),
            "samples": len(samples),
            f"avg@{k}": sum(r["score"] for r in samples) / len(samples),
            f"avg@{k}_se": standard_error([mean(r["score"] for r in rs)
                                           for rs in problems.values()]),
            f"pass@{k}": sum(pass_at_k(len(problems[p]), c, k) for p, c in correct.items())
            / len(problems),
            "mean_response_tokens": sum(r["response_tokens"] for r in samples) / len(samples),
            "truncation_rate": sum(r["finish_reason"] == "length" for r in samples) / len(samples),
        }
        if all("tool_calls" in r for r in samples):  # multi-turn tool trajectories
            report[bench].update({key: mean(float(r[f] if isinstance(f, str) else f(r))
                                            for r in samples)
                                  for key, f in TOOL_METRICS.items()})
    return report


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (sample std / sqrt(n)); 0 for one value.

    Over problems, with each problem's mean score as one value: the k samples of a problem
    are not independent draws of the benchmark, its problems are."""
    return stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def problem_means(samples_path: str | Path, benchmark: str) -> dict[int, float]:
    """Each problem's mean score in a klear-eval ``samples.jsonl``, for ``benchmark``."""
    means = {p: mean(r["score"] for r in rs)
             for (name, p), rs in _done(Path(samples_path)).items() if name == benchmark}
    if not means:
        raise ValueError(f"{samples_path}: no samples of benchmark {benchmark!r}")
    return means


def paired_gain(before: str | Path, after: str | Path, benchmark: str) -> tuple[float, float]:
    """(mean gain, its standard error) of ``after`` over ``before`` (two ``samples.jsonl`` of
    the same problems), paired per problem: the problems' own difficulty, shared by both
    runs, leaves the error of the difference."""
    b, a = problem_means(before, benchmark), problem_means(after, benchmark)
    if b.keys() != a.keys():
        raise ValueError(f"{before} and {after} hold different problems of {benchmark!r}")
    diffs = [a[p] - b[p] for p in sorted(b)]
    return mean(diffs), standard_error(diffs)


def rejudge(samples_path: str | Path, k: int | None = None) -> dict[str, dict]:
    """Re-score saved responses with the reward registry (no model) and summarise."""
    recs = [r for rs in _done(Path(samples_path)).values() for r in rs]
    if not recs:
        raise FileNotFoundError(f"--rejudge {samples_path}: no samples found")
    by_reward: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_reward[r["reward_name"]].append(r)
    for name, rs in by_reward.items():
        for r, s in zip(rs, score_batch(name, [r["response"] for r in rs],
                                        [r["label"] for r in rs])):
            r["score"] = float(s)
    if k is None:
        counts = defaultdict(int)
        for r in recs:
            counts[(r["benchmark"], r["problem"])] += 1
        k = min(counts.values())
    return summarize(recs, k)


def write_report(report: dict[str, dict], out_dir: str | Path, meta: dict | None = None) -> Path:
    """``report.json`` and ``report.md`` in ``out_dir`` (written atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmarks": report, **({"meta": meta} if meta else {})}
    write_text(out / "report.json", json.dumps(payload, indent=2))
    cols = sorted({c for row in report.values() for c in row})
    lines = ["| benchmark | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in report.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.json"


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)
