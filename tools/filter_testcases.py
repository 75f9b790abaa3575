"""Drop code problems whose tests no solution passes (pass@k == 0: flawed tests).

Reference mode (solutions given in the data; HumanEval's canonical_solution is a body, so
prefix the prompt):
    python tools/filter_testcases.py --input code.jsonl --output code.clean.jsonl \
        --solution-key canonical_solution --solution-prefix-key prompt

Rollout mode (sample --k responses per problem from running rollout servers):
    python tools/filter_testcases.py --input code.jsonl --output code.clean.jsonl \
        --rollout-url http://host:30000 --tokenizer /path/to/hf_model --k 16

Writes the kept records and a JSON report of every problem's pass count, atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

from megatron_klear.config import OneLineParser
from megatron_klear.data.prompts import DataError, load_prompt_dataset, load_records, \
    record_field, render_prompt
from megatron_klear.data.records_io import write_json, write_records
from megatron_klear.data.testcase_filter import fence_python, judge_problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="code problems (.jsonl or .parquet)")
    p.add_argument("--output", required=True, help="kept problems (.jsonl or .parquet)")
    p.add_argument("--report", default=None, help="JSON report (default: OUTPUT.report.json)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--messages-key", default=None)
    p.add_argument("--answer-key", default="answer",
                   help="field with the tests (else test+entry_point or inputs+outputs)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--solution-key", help="field with a reference solution or a list of them")
    src.add_argument("--rollout-url", nargs="+", help="rollout server URL(s) to sample from")
    p.add_argument("--solution-prefix-key", default=None,
                   help="field prepended to each reference solution (HumanEval: prompt)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir (rollout mode)")
    p.add_argument("--k", type=int, default=16, help="responses per problem (rollout mode)")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-workers", type=int, default=None, help="concurrent evaluations")
    return p.parse_args(argv)


def reference_responses(records: list[tuple[int, dict]], args: argparse.Namespace) -> list[list[str]]:
    """Each problem's reference solutions as fenced responses."""
    out = []
    for line, rec in records:
        sols = record_field(rec, args.solution_key)
        if sols is None:
            raise DataError(f"{args.input}:{line}: missing field '{args.solution_key}' "
                            "(set --solution-key ...)")
        sols = [sols] if isinstance(sols, str) else list(sols)
        prefix = (record_field(rec, args.solution_prefix_key) or "") \
            if args.solution_prefix_key else ""
        out.append([fence_python(prefix + s) for s in sols])
    return out


def sampled_responses(samples: list, args: argparse.Namespace) -> list[list[str]]:
    """k responses per problem from the rollout servers (imported only in this mode)."""
    from transformers import AutoTokenizer

    from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams

    if args.tokenizer is None:
        raise DataError("rollout mode needs --tokenizer (to apply the chat template)")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = [render_prompt(tok, s.messages) for s in samples]
    gens = RolloutClient(args.rollout_url).generate(
        prompts, SamplingParams(n=args.k, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature))
    return [[g.text for g in per_prompt] for per_prompt in gens]


def run(args: argparse.Namespace) -> dict:
    records = list(load_records(args.input))
    samples = load_prompt_dataset(args.input, prompt_key=args.prompt_key,
                                  answer_key=args.answer_key, messages_key=args.messages_key)
    responses = reference_responses(records, args) if args.solution_key \
        else sampled_responses(samples, args)
    verdicts = judge_problems(responses, [s.label for s in samples],
                              k=None if args.solution_key else args.k, num_workers=args.num_workers)
    kept = [rec for (_, rec), v in zip(records, verdicts) if v.kept]
    report = {"input": args.input, "total": len(records), "kept": len(kept),
              "removed": len(records) - len(kept),
              "removed_lines": [line for (line, _), v in zip(records, verdicts) if not v.kept],
              "problems": [dict(asdict(v), line=line) for (line, _), v in zip(records, verdicts)]}
    write_records(args.output, kept)
    write_json(args.report or args.output + ".report.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (DataError, ValueError) as exc:
        print(f"filter_testcases: error: {exc}", file=sys.stderr)
        return 2
    print(f"kept {report['kept']} of {report['total']} problems, removed lines "
          f"{report['removed_lines']} -> {os.path.abspath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
