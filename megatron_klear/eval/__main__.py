"""``klear-eval``: avg@k / pass@k of a model on JSONL benchmarks, or re-judging saved samples.

  klear-eval --model DIR --benchmark aime=aime24.jsonl --benchmark lcb=lcb.jsonl@code \\
             --k 16 --temperature 1.0 --max-new-tokens 32768 --out-dir eval/
  klear-eval --rejudge eval/samples.jsonl

--model is a Hugging Face dir or a megatron-klear checkpoint dir (converted on the fly, with
the tokenizer of --hf-config; the trainer's layout flags are accepted and checked against the
model).
Without --rollout-urls, embedded rollout servers are started on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from megatron_klear.config import TrainConfig, add_layout_flags, layout_from_args
from megatron_klear.eval.evaluate import evaluate, parse_benchmark, rejudge, write_report


def build_parser() -> argparse.ArgumentParser:
    """The klear-eval flags."""
    p = argparse.ArgumentParser(prog="klear-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir or megatron-klear checkpoint dir")
    p.add_argument("--hf-config", default=None,
                   help="HF dir giving the tokenizer (and config.json) of a megatron-klear "
                        "checkpoint given as --model, as for tools/convert_megatron_to_hf.py")
    p.add_argument("--benchmark", action="append", default=[],
                   help="[name=]path.jsonl[@reward] (reward: math, code or pkg.mod:fn; "
                        "default math)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--answer-format", default=None, help="e.g. gsm8k ('#### N' answers)")
    p.add_argument("--prompt-template", choices=("chat", "raw"), default=None,
                   help="chat (the tokenizer's chat template) or raw text; default chat when "
                        "the tokenizer has a template, else raw")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file replacing the tokenizer's")
    p.add_argument("--chat-template-kwargs", default=None,
                   help="JSON object of chat-template arguments, e.g. "
                        "'{\"enable_thinking\": false}' (Qwen3's non-thinking mode)")
    p.add_argument("--k", type=int, default=4, help="samples per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--yarn-factor", type=float, default=None,
                   help="YaRN rope scaling for longer contexts (SGLang servers)")
    p.add_argument("--rollout-urls", nargs="+", default=None)
    p.add_argument("--num-servers", type=int, default=None,
                   help="embedded servers to start (default: one per core, at most 4)")
    p.add_argument("--out-dir", default="eval_out")
    p.add_argument("--rejudge", default=None, help="samples.jsonl to re-score (no model)")
    p.add_argument("--seed", type=int, default=0)
    add_layout_flags(p)
    return p


def resolve_model(model: str, out_dir: Path, layout: TrainConfig | None = None,
                  hf_config: str | None = None) -> Path:
    """An HF dir for ``model``: itself, or a conversion of a megatron-klear checkpoint (whose
    model ``layout``, the layout flags, must be able to split) with the tokenizer of
    ``hf_config`` (a checkpoint holds none)."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    if (path / "latest_checkpointed_iteration.txt").is_file():
        from megatron_klear.checkpoint.convert import convert_megatron_to_hf

        if hf_config is None:
            raise FileNotFoundError(f"--model {model} is a megatron-klear checkpoint, which holds "
                                    "no tokenizer: add --hf-config <the HF dir it was trained "
                                    "from>")
        target = out_dir / "hf_model"
        if not (target / "config.json").is_file():
            convert_megatron_to_hf(path, target, hf_config_dir=hf_config, layout=layout)
        return target
    raise FileNotFoundError(f"--model {model}: neither an HF dir (config.json) nor a "
                            "megatron-klear checkpoint (latest_checkpointed_iteration.txt)")


def run(args: argparse.Namespace) -> dict:
    """Run the evaluation described by the flags and write the report."""
    out = Path(args.out_dir)
    if args.rejudge:
        report = rejudge(args.rejudge, k=None)
        write_report(report, out, {"rejudged": args.rejudge})
        return report
    if not args.model or not args.benchmark:
        raise FileNotFoundError("--model and at least one --benchmark are required "
                                "(or --rejudge samples.jsonl)")
    if args.k < 1:
        raise ValueError("--k must be >= 1")
    from megatron_klear.data.prompts import load_tokenizer, parse_chat_template_kwargs

    template_kwargs = parse_chat_template_kwargs(args.chat_template_kwargs)
    from megatron_klear.rollout.client import RolloutClient, SamplingParams
    from megatron_klear.rollout.launcher import connect, embedded_server_layout, \
        launch_embedded_servers

    out.mkdir(parents=True, exist_ok=True)
    hf_dir = resolve_model(args.model, out, layout_from_args(args), args.hf_config)
    tokenizer = load_tokenizer(hf_dir, args.prompt_template, args.chat_template, template_kwargs)
    benches = [parse_benchmark(b, prompt_key=args.prompt_key, answer_key=args.answer_key,
                               answer_format=args.answer_format) for b in args.benchmark]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, stop_token_ids=[tokenizer.eos_token_id])
    if args.yarn_factor and not args.rollout_urls:
        raise ValueError("--yarn-factor needs SGLang servers (--rollout-urls started with "
                         "launch_sglang_servers(yarn_factor=...)); the embedded server has none")
    count, threads = embedded_server_layout(args.num_servers)
    servers = (connect(args.rollout_urls) if args.rollout_urls else
               launch_embedded_servers(str(hf_dir), count, seed=args.seed, num_threads=threads))
    with servers:
        report = evaluate(RolloutClient(servers.urls), tokenizer, benches, k=args.k,
                          params=params, samples_path=out / "samples.jsonl", seed=args.seed)
    write_report(report, out, {"model": str(args.model), "k": args.k,
                               "temperature": args.temperature, "top_p": args.top_p,
                               "max_new_tokens": args.max_new_tokens})
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``klear-eval``."""
    from megatron_klear.cli import run_main

    args = build_parser().parse_args(argv)
    report = run_main(lambda: run(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
