"""``klear-eval``: avg@k / pass@k of a model on JSONL benchmarks, or re-judging saved samples.

  klear-eval --model DIR --benchmark aime=aime24.jsonl --benchmark lcb=lcb.jsonl@code \\
             --k 16 --temperature 1.0 --max-new-tokens 32768 --out-dir eval/
  klear-eval --rejudge eval/samples.jsonl

--model is a Hugging Face dir or a megatron-klear checkpoint dir (converted on the fly, with
the tokenizer of --hf-config; the trainer's layout flags are accepted and checked against the
model).
With --tools (klear-rl's tool flags: --tool-parser, --max-turns, --max-tool-response-tokens,
--tool-timeout) each sample is a multi-turn tool trajectory, --max-new-tokens its budget of
sampled + tool tokens; the reward scores the final answer.
Without --rollout-urls, embedded rollout servers are started on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from megatron_klear.config import ConfigError, OneLineParser, TrainConfig, add_layout_flags, \
    add_section_flags, layout_from_args, section_from_args
from megatron_klear.data.prompt_flags import PromptFlags
from megatron_klear.eval.evaluate import Benchmark, evaluate, parse_benchmark, rejudge, \
    write_report
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig
from megatron_klear.rollout.orchestration.request import SamplingParams
from megatron_klear.rollout.orchestration.tool_flags import (RAW_WITH_TOOLS, ToolFlags,
                                                             check_tools_chat_template)

# klear-eval's sampling flags on the one sampling contract's fields
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p",
                  "max_new_tokens": "--max-new-tokens"}


def build_parser() -> argparse.ArgumentParser:
    """The klear-eval flags."""
    p = OneLineParser(prog="klear-eval", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir or megatron-klear checkpoint dir")
    p.add_argument("--hf-config", default=None,
                   help="HF dir giving the tokenizer (and config.json) of a megatron-klear "
                        "checkpoint given as --model, as for tools/convert_megatron_to_hf.py")
    p.add_argument("--benchmark", action="append", default=[],
                   help="[name=]path.jsonl[@reward] (reward: math, code or pkg.mod:fn; "
                        "default math)")
    add_section_flags(p, PromptFlags)
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
    add_section_flags(p, ToolFlags)
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


def sampling_params(args: argparse.Namespace, **request) -> SamplingParams:
    """The sampling of every benchmark (``request``: stop tokens, ...)."""
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, **request)


def check_args(args: argparse.Namespace
               ) -> tuple[PromptFlags, list[Benchmark], MultiTurnConfig | None]:
    """Validate the flags and the benchmark files (exist, first records parse, rewards
    resolve) before any model is converted or server started; returns the prompt flags,
    the benchmarks and the tools' config (None without --tools). Raises ConfigError /
    DataError naming the flag or FILE:LINE."""
    from megatron_klear.rewards import check_reward

    if not args.model or not args.benchmark:
        raise ConfigError("--model and at least one --benchmark are required "
                          "(or --rejudge samples.jsonl)")
    if args.k < 1:
        raise ConfigError(f"--k must be >= 1, got {args.k}")
    sampling_params(args).check_flags(SAMPLING_FLAGS)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.yarn_factor and not args.rollout_urls:
        raise ConfigError("--yarn-factor needs SGLang servers (--rollout-urls started with "
                          "launch_sglang_servers(yarn_factor=...)); the embedded server has none")
    prompts = section_from_args(PromptFlags, args)
    prompts.check_inputs(None)
    multi_turn = section_from_args(ToolFlags, args).multi_turn_config(args.max_new_tokens)
    if multi_turn and prompts.prompt_template == "raw":
        raise ConfigError(RAW_WITH_TOOLS)
    benches = [parse_benchmark(b, prompt_key=prompts.prompt_key, answer_key=prompts.answer_key,
                               answer_format=prompts.answer_format) for b in args.benchmark]
    for spec, bench in zip(args.benchmark, benches):
        prompts.check_prompts("--benchmark", bench.path)
        check_reward(bench.reward, f"--benchmark {spec}: reward")
    return prompts, benches, multi_turn


def run(args: argparse.Namespace) -> dict:
    """Run the evaluation described by the flags and write the report."""
    out = Path(args.out_dir)
    if args.rejudge:
        report = rejudge(args.rejudge, k=None)
        write_report(report, out, {"rejudged": args.rejudge})
        return report
    prompts, benches, multi_turn = check_args(args)
    from megatron_klear.data.prompts import load_tokenizer, parse_chat_template_kwargs

    template_kwargs = parse_chat_template_kwargs(prompts.chat_template_kwargs)
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.engine.launcher import connect, embedded_server_layout, \
        launch_embedded_servers

    out.mkdir(parents=True, exist_ok=True)
    hf_dir = resolve_model(args.model, out, layout_from_args(args), args.hf_config)
    # tools need the chat template (it renders the calls and responses): never raw
    tokenizer = load_tokenizer(hf_dir, prompts.prompt_template or ("chat" if multi_turn else
                                                                   None),
                               prompts.chat_template, template_kwargs)
    check_tools_chat_template(tokenizer, multi_turn)
    params = sampling_params(args, stop_token_ids=[tokenizer.eos_token_id])
    count, threads = embedded_server_layout(args.num_servers)
    servers = (connect(args.rollout_urls) if args.rollout_urls else
               launch_embedded_servers(str(hf_dir), count, seed=args.seed, num_threads=threads))
    with servers:
        report = evaluate(RolloutClient(servers.urls), tokenizer, benches, k=args.k,
                          params=params, samples_path=out / "samples.jsonl", seed=args.seed,
                          multi_turn=multi_turn)
    tools = {"tools": args.tools, "max_turns": args.max_turns} if multi_turn else {}
    write_report(report, out, {"model": str(args.model), "k": args.k,
                               "temperature": args.temperature, "top_p": args.top_p,
                               "max_new_tokens": args.max_new_tokens, **tools})
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``klear-eval``."""
    from megatron_klear.cli import run_main

    args = build_parser().parse_args(argv)
    report = run_main(lambda: run(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
