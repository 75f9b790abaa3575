"""Remove training prompts that share a word n-gram (default 9) with any evaluation set.

    python tools/decontaminate.py --train train.jsonl --eval aime24.jsonl math500.jsonl \
        --output train.clean.jsonl --report decontam.json

Writes the kept records (same format as --output's extension) and a JSON report listing
every removed record with the evaluation item and n-gram it matched. Both atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from tqdm import tqdm

from megatron_klear.config import OneLineParser
from megatron_klear.data.decontaminate import DEFAULT_N, DEFAULT_TEXT_KEYS, NGramIndex, record_text
from megatron_klear.data.prompts import DataError, load_records
from megatron_klear.data.records_io import write_json, write_records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="training set (.jsonl or .parquet)")
    p.add_argument("--eval", required=True, nargs="+", help="evaluation set(s) to protect")
    p.add_argument("--output", required=True, help="filtered training set (.jsonl/.parquet)")
    p.add_argument("--report", default=None, help="JSON report (default: OUTPUT.report.json)")
    p.add_argument("--ngram", type=int, default=DEFAULT_N, help="n-gram size in words")
    p.add_argument("--text-key", nargs="+", default=list(DEFAULT_TEXT_KEYS),
                   help="record fields holding the text, first present wins")
    return p.parse_args(argv)


def _texts(path: str, keys: list[str]) -> list[tuple[int, dict, str]]:
    rows = []
    for line, rec in load_records(path):
        try:
            rows.append((line, rec, record_text(rec, keys)))
        except KeyError as exc:
            raise DataError(f"{path}:{line}: {exc.args[0]}") from None
    return rows


def run(args: argparse.Namespace) -> dict:
    if args.ngram < 1:
        raise DataError(f"--ngram must be >= 1, got {args.ngram}")
    index = NGramIndex(args.ngram)
    eval_lines = {}
    for path in args.eval:
        rows = _texts(path, args.text_key)
        index.add(path, [t for _, _, t in rows])
        eval_lines[path] = [line for line, _, _ in rows]
    kept, removed = [], []
    for i, (line, rec, text) in enumerate(tqdm(_texts(args.train, args.text_key),
                                               desc="decontaminate", unit="prompt")):
        hit = index.match(i, text)
        if hit is None:
            kept.append(rec)
        else:
            removed.append({"train_line": line, "eval_file": hit.eval_set,
                            "eval_line": eval_lines[hit.eval_set][hit.eval_index],
                            "ngram": hit.ngram})
    report = {"train": args.train, "eval": args.eval, "ngram": args.ngram,
              "total": len(kept) + len(removed), "kept": len(kept), "removed": len(removed),
              "removed_per_eval": dict(Counter(r["eval_file"] for r in removed)),
              "removed_items": removed}
    write_records(args.output, kept)
    write_json(args.report or args.output + ".report.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (DataError, ValueError) as exc:
        print(f"decontaminate: error: {exc}", file=sys.stderr)
        return 2
    print(f"kept {report['kept']} of {report['total']}, removed {report['removed']} "
          f"{report['removed_per_eval']} -> {os.path.abspath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
