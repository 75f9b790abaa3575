"""Bad command lines and data files end with exit 2 and one line naming the flag or
FILE:LINE, in ``--dry-run`` and in the real run alike, before anything is built (issue 39).

The rows of the issue's table run through the real CLIs (``python -m ...``); the dry run
and the real run of a row start side by side. The model is a tiny config.json (no
weights): a run that got past its checks would fail on the missing weights, not with a
one-line exit 2.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_klear.config import ConfigError, parse_config
from megatron_klear.models.tiny import tiny_qwen3_config, tiny_qwen3_moe_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "klear_8b"


def _jsonl(path: Path, records: list, tail: str = "") -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """A dense and an MoE config.json, good prompts, prompts with a torn 3rd line, and a
    file of 100 good prompts cut short in its last line."""
    d = tmp_path_factory.mktemp("inputs")
    models = {}
    for name, cfg in (("dense", tiny_qwen3_config()), ("moe", tiny_qwen3_moe_config())):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(cfg))
        models[name] = str(d / name)
    good = [{"prompt": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(100)]
    return {**models, "dir": d,
            "good": _jsonl(d / "good.jsonl", good[:8]),
            "torn": _jsonl(d / "torn.jsonl", good[:2], '{"prompt": "3 + 1 = ?", "ans\n'
                           + json.dumps(good[3]) + "\n"),
            "cut": _jsonl(d / "cut.jsonl", good, '{"prompt": "100 + 1'),
            "sft_torn": _jsonl(d / "sft.jsonl", [{"prompt": "a", "response": "b"}],
                               '{"prompt": "c", "respo\n')}


def _env() -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    return env


def _start(module: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line_exit_2(proc: subprocess.Popen, wants: str) -> str:
    _, err = proc.communicate(timeout=600)
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, err[-3000:])
    assert wants in lines[0], lines[0]
    return lines[0]


def _rows(i: dict) -> list[tuple[str, list[str], str]]:
    """The issue's table: (row, klear-rl flags over the tiny dense model and good prompts,
    what the line names)."""
    return [
        ("klear_8b recipe at --train-iters 3",
         ["--config", str(RECIPE / "rl_math.yaml"), "--hf-checkpoint",
          str(RECIPE / "hf_config"), "--train-iters", "3"], "--lr-warmup-iters 10"),
        ("--reward maht", ["--reward", "maht"], "--reward maht"),
        ("--use-routing-replay on a dense model", ["--use-routing-replay"],
         "--use-routing-replay"),
        ("--prompt-data that does not exist", ["--prompt-data", str(i["dir"] / "none.jsonl")],
         f"--prompt-data {i['dir'] / 'none.jsonl'}"),
        ("a torn JSONL line", ["--prompt-data", i["torn"]], f"{i['torn']}:3"),
        ("--global-batch-size", ["--global-batch-size", "7"], "--global-batch-size"),
    ]


ROW_NAMES = [r[0] for r in _rows({"dir": Path("."), "torn": "", "cut": ""})]


@pytest.mark.parametrize("row", ROW_NAMES)
def test_table_rows_exit_2_with_one_line_in_dry_and_real_run(inputs, row):
    """Each row through ``python -m megatron_klear.train.rl``, with and without --dry-run."""
    _, flags, wants = next(r for r in _rows(inputs) if r[0] == row)
    argv = ["--hf-checkpoint", inputs["dense"], "--prompt-data", inputs["good"], *flags]
    dry, real = (_start("megatron_klear.train.rl", argv + extra) for extra in (["--dry-run"], []))
    _one_line_exit_2(dry, wants)
    _one_line_exit_2(real, wants)


def test_the_same_flags_pass_when_valid(inputs, capsys, monkeypatch):
    """The control of the rows: valid inputs pass the checks (the dry run plans, exit 0);
    routing replay on the MoE model is accepted (klear-rl's main, in this process)."""
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rl.main(["--dry-run", "--hf-checkpoint", inputs["moe"], "--prompt-data", inputs["good"],
             "--use-routing-replay", "--reward", "math_klear", "--eval-data", inputs["good"]])
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):])
    assert report["config"]["global_batch_size"] == 16 * 8  # derived: mini-batch x n


def _exits_2_with_one_line(main, argv: list[str], wants: str, capsys) -> None:
    """``main(argv)`` (a console script's function, in this process) exits 2 with one line
    on stderr that names ``wants``."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1 and wants in lines[0], lines


def test_sft_data_and_eval_benchmarks_exit_2_with_one_line(inputs, capsys, monkeypatch):
    """klear-sft's --data-path (missing in the dry run; a torn line in the real run) and
    klear-eval's --benchmark files, reward and flags, before any model is converted or
    server started (through the console scripts' functions, in this process)."""
    from megatron_klear.eval.__main__ import main as eval_main
    from megatron_klear.train import sft

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    missing = str(inputs["dir"] / "none.jsonl")
    out_dir = str(inputs["dir"] / "eval")
    base = ["--hf-checkpoint", inputs["dense"]]
    _exits_2_with_one_line(sft.main, base + ["--data-path", missing, "--dry-run"],
                           f"--data-path {missing}: no such file", capsys)
    _exits_2_with_one_line(sft.main, base + ["--data-path", inputs["sft_torn"]],
                           f"{inputs['sft_torn']}:2", capsys)
    for flags, wants in ((["--benchmark", missing], f"--benchmark {missing}: no such file"),
                         (["--benchmark", inputs["torn"]], f"{inputs['torn']}:3"),
                         (["--benchmark", inputs["good"] + "@maht"], "reward maht"),
                         (["--benchmark", inputs["good"], "--top-p", "0"], "--top-p"),
                         (["--benchmark", inputs["good"], "--answer-format", "gsm9k"],
                          "--answer-format")):
        _exits_2_with_one_line(eval_main, ["--model", inputs["dense"], "--out-dir", out_dir,
                                           *flags], wants, capsys)
    assert not Path(out_dir).exists()  # nothing written, nothing started


def test_bad_sft_multi_turn_exits_2_with_one_line(inputs, capsys, monkeypatch):
    """--sft-multi-turn takes whole or per-turn (issue 56): another value is one line naming
    the flag and its values, exit 2, in the dry run and the real run (klear-sft's main)."""
    from megatron_klear.train import sft

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = _jsonl(inputs["dir"] / "sft_good.jsonl", [{"prompt": "a", "response": "b"}])
    for extra in (["--dry-run"], []):
        _exits_2_with_one_line(sft.main, ["--hf-checkpoint", inputs["dense"], "--data-path", data,
                                          "--sft-multi-turn", "perturn", *extra],
                               "--sft-multi-turn: invalid choice: 'perturn' (choose from "
                               "'whole', 'per-turn')", capsys)


@pytest.mark.parametrize("flags, wants", [
    (["--seq-length", "64"], "--seq-length is not read by klear-rl"),
    (["--prompt-data", "{cut}"], "{cut}:101"),
    (["--reward", "no_such_pkg.mod:fn"], "--reward no_such_pkg.mod:fn"),
    (["--eval-data", "{torn}"], "{torn}:3"),
    (["--chat-template-kwargs", "{{x"], "--chat-template-kwargs"),
    (["--chat-template", "{dir}/none.jinja"], "--chat-template"),
    (["--kl-coef", "0.1", "--ref-load", "{dir}/none"], "--ref-load"),
    (["--answer-format", "gsm9k"], "--answer-format"),
    (["--rollout-top-p", "0"], "--rollout-top-p"),
    (["--eval-temperature", "-1"], "--eval-temperature"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--micro-batch-size", "3"], "--micro-batch-size"),
    # issue 51, defect 2: given engines' memory is said, never assumed
    (["--colocate", "--rollout-urls", "http://127.0.0.1:9"], "--rollout-engine-memory"),
    (["--rollout-engine-memory", "launched"], "--rollout-engine-memory applies only"),
])
def test_other_bad_rl_inputs_exit_2_with_one_line(inputs, capsys, flags, wants, monkeypatch):
    """More bad inputs through klear-rl's main (the console script's function, in this
    process: no new interpreter per case), dry run and real run."""
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = [f.format(**inputs) for f in flags]
    wants = wants.format(**inputs)
    for extra in (["--dry-run"], []):
        _exits_2_with_one_line(rl.main, ["--hf-checkpoint", inputs["dense"], "--prompt-data",
                                         inputs["good"], *flags, *extra], wants, capsys)


def test_bad_cpu_gemm_variable_exits_2_with_one_line(inputs, capsys, monkeypatch):
    """KLEAR_CPU_GEMM (platform.cpu_gemm_choice) is checked in the preflight of both
    trainers, dry run and real run, before anything is built."""
    from megatron_klear.train import rl, sft

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("KLEAR_CPU_GEMM", "blas")
    wants = "KLEAR_CPU_GEMM='blas' names no CPU GEMM: use one of onednn, mkl"
    for extra in (["--dry-run"], []):
        _exits_2_with_one_line(rl.main, ["--hf-checkpoint", inputs["dense"], "--prompt-data",
                                         inputs["good"], *extra], wants, capsys)
        _exits_2_with_one_line(sft.main, ["--hf-checkpoint", inputs["dense"], "--data-path",
                                          inputs["sft_torn"], *extra], wants, capsys)


def test_model_folder_without_config_json_is_refused_by_the_dry_run(inputs, capsys,
                                                                     monkeypatch):
    """A --hf-checkpoint folder that is on this machine but holds no config.json: exit 2 with
    one line naming the folder, in the dry run as in the real run (a folder that is not here
    at all is a dry run for another machine: planned without the model)."""
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    empty = inputs["dir"] / "no_config"
    empty.mkdir(exist_ok=True)
    for extra in (["--dry-run"], []):
        _exits_2_with_one_line(rl.main, ["--hf-checkpoint", str(empty), "--prompt-data",
                                         inputs["good"], *extra], f"{empty}/config.json",
                               capsys)


def test_tools_with_a_template_that_cannot_render_them_is_refused_by_the_dry_run(
        inputs, capsys, monkeypatch):
    """--tools with a chat template that cannot carry tool turns (a Qwen3-like template
    without tool support, --chat-template): exit 2 with one line, dry run and real run
    alike; the model's own tool template passes the dry run (the control)."""
    from megatron_klear.models.tiny import TOOL_CHAT_TEMPLATE, build_tokenizer
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = inputs["dir"] / "tool_tokenizer"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(tiny_qwen3_config()))
    build_tokenizer(model, chat_template=TOOL_CHAT_TEMPLATE)
    argv = ["--hf-checkpoint", str(model), "--prompt-data", inputs["good"], "--tools", "python"]
    plain = ["--chat-template", str(ROOT / "tests" / "data" / "qwen3_like_chat_template.jinja")]
    for extra in (["--dry-run"], []):
        _exits_2_with_one_line(rl.main, [*argv, *plain, *extra], "--tools: the chat template",
                               capsys)
    rl.main([*argv, "--dry-run"])
    assert '"dry_run"' in capsys.readouterr().out


@pytest.mark.parametrize("style", ["constant", "cosine", "linear"])
def test_warmup_against_decay_steps_for_every_style(style):
    """megatron-core's OptimizerParamScheduler asserts warm-up < decay steps whatever the
    style; the config refuses it first, and accepts the same warm-up with more decay steps."""
    from megatron_klear.config import TrainConfig

    base = ["--lr-decay-style", style, "--lr-warmup-iters", "10", "--min-lr", "0"]
    for bad in (["--train-iters", "3"], ["--train-iters", "10"],
                ["--train-iters", "500", "--lr-decay-iters", "10"]):
        with pytest.raises(ConfigError, match="--lr-warmup-iters 10 must be smaller"):
            parse_config(TrainConfig, base + bad)
    cfg = parse_config(TrainConfig, base + ["--train-iters", "3", "--lr-decay-iters", "11"])
    assert cfg.decay_iters == 11 and cfg.train_iters == 3


def test_validation_changes_no_value_and_derive_does():
    """validate() leaves every field as given; derive() sets the values that follow."""
    import dataclasses

    from megatron_klear.train.rl_config import RLConfig

    cfg = RLConfig(hf_checkpoint="hf", prompt_data="p.jsonl", mini_batch_size=4,
                   n_samples_per_prompt=2, rollout_batch_size=8, rollout_gen_batch_size=0)
    before = dataclasses.asdict(cfg)
    cfg.validate()
    assert dataclasses.asdict(cfg) == before
    cfg.derive()
    assert cfg.global_batch_size == 8 and cfg.rollout_gen_batch_size is None


def test_prompt_and_sampling_flags_are_one_contract_across_the_clis():
    """klear-rl, klear-sft and klear-eval take the same prompt flags (name, type, default,
    help), klear-rl and klear-eval the same tool flags; the rollout client and the embedded
    server share one SamplingParams."""
    from megatron_klear.config import _build_parser
    from megatron_klear.data.prompt_flags import PromptFlags
    from megatron_klear.eval.__main__ import build_parser
    from megatron_klear.rollout.engine import server
    from megatron_klear.rollout.orchestration import client
    from megatron_klear.rollout.orchestration.tool_flags import ToolFlags
    from megatron_klear.train.rl_config import RLConfig
    from megatron_klear.train.sft_config import SFTConfig

    def actions(parser):
        return {a.dest: (a.option_strings, a.type, a.default, a.help, a.choices)
                for a in parser._actions}

    rl, sft, ev = (actions(p) for p in (_build_parser(RLConfig, None),
                                        _build_parser(SFTConfig, None), build_parser()))
    shared = [f.name for f in dataclasses.fields(PromptFlags)]
    tools = [f.name for f in dataclasses.fields(ToolFlags)]
    assert len(shared) == 6 and tools == ["tools", "tool_parser", "max_turns",
                                          "max_tool_response_tokens", "tool_timeout",
                                          "max_tool_calls"]
    for name in shared + tools:
        assert ev[name][:2] == rl[name][:2] and ev[name][3:] == rl[name][3:], name
    assert sft["chat_template_kwargs"][3] == rl["chat_template_kwargs"][3]
    assert client.SamplingParams is server.SamplingParams
