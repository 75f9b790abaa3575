"""Prompt rendering: --prompt-template {chat,raw} and --chat-template FILE (issue 18).

Unit checks on the real tiny tokenizer (a transformers PreTrainedTokenizerFast), then the
real CLIs (klear-rl, klear-eval as subprocesses) on a model whose tokenizer has no chat
template: they run (raw, with a notice); asking for chat is a one-line error (their
console-script functions, in this process).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from megatron_klear.data.prompts import DataError, render_prompt, set_prompt_template
from megatron_klear.models.tiny import build_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
REWARD = "tests.reward_plugins:parity_reward"


def _plain_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = None
    return tok


def test_chat_is_the_default_when_the_tokenizer_has_a_template(capsys):
    tok = build_tokenizer()
    assert set_prompt_template(tok) == "chat"
    assert render_prompt(tok, MESSAGES) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                            "<|im_start|>user\n2+2?<|im_end|>\n"
                                            "<|im_start|>assistant\n")
    assert capsys.readouterr().err == ""


def test_raw_renders_the_contents_only():
    tok = build_tokenizer()
    assert set_prompt_template(tok, "raw") == "raw"
    assert render_prompt(tok, MESSAGES) == "Be brief.\n\n2+2?"
    assert render_prompt(tok, MESSAGES[1:]) == "2+2?"


def test_no_template_falls_back_to_raw_with_a_one_line_notice(capsys):
    tok = _plain_tokenizer()
    assert set_prompt_template(tok) == "raw"
    assert render_prompt(tok, MESSAGES[1:]) == "2+2?"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-template raw" in err and "--chat-template" in err


def test_chat_template_file_is_used(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = _plain_tokenizer()
    assert set_prompt_template(tok, "chat", path) == "chat"
    assert render_prompt(tok, MESSAGES) == "[system] Be brief.\n[user] 2+2?\n[assistant] "


@pytest.mark.parametrize("kwargs,match", [
    ({"prompt_template": "chat"}, "--prompt-template chat: the tokenizer has no chat template; "
                                  "pass --chat-template FILE"),
    ({"chat_template": "missing.jinja"}, "--chat-template missing.jinja: no such file"),
    ({"prompt_template": "raw", "chat_template": "x.jinja"}, "--chat-template is used only "
                                                              "with --prompt-template chat"),
    ({"prompt_template": "fancy"}, "--prompt-template 'fancy'"),
])
def test_bad_choices_name_the_flag(kwargs, match):
    with pytest.raises(DataError, match=match):
        set_prompt_template(_plain_tokenizer(), **kwargs)


# ---------------------------------------------------------------- real CLIs
@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A tiny HF model whose tokenizer has no chat template, and a prompt file."""
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("plain")
    hf = save_tiny_hf_model(root / "hf", seed=0, std=0.2)
    (hf / "chat_template.jinja").unlink()
    config = json.loads((hf / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "answer": "x"}) + "\n"
                            for i in range(4)))
    return hf, data


def _rl(hf, data, save, *extra):
    return [sys.executable, "-m", "megatron_klear.train.rl", "--hf-checkpoint", str(hf),
            "--prompt-data", str(data), "--save", str(save), "--reward", REWARD,
            "--rollout-batch-size", "2", "--mini-batch-size", "2", "--n-samples-per-prompt", "2",
            "--micro-batch-size", "4", "--rollout-max-response-len", "4", "--train-iters", "1",
            "--no-progress-bar", "--no-probe-weights", *extra]


def _eval(hf, data, out, *extra):
    return [sys.executable, "-m", "megatron_klear.eval", "--model", str(hf), "--benchmark",
            f"toy={data}@{REWARD}", "--k", "2", "--max-new-tokens", "4", "--out-dir", str(out),
            *extra]


def test_klear_rl_and_klear_eval_run_without_a_chat_template(plain_model, tmp_path):
    hf, data = plain_model
    with socket.socket() as busy:  # one-process klear-rl picks a free port, not torch's 29500
        busy.bind(("127.0.0.1", 29500))
        busy.listen()
        rl = subprocess.run(_rl(hf, data, tmp_path / "rl"), capture_output=True, text=True,
                            timeout=300)
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert "prompts are rendered raw" in rl.stderr
    assert len((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()) == 1
    ev = subprocess.run(_eval(hf, data, tmp_path / "ev"), capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "prompts are rendered raw" in ev.stderr
    report = json.loads((tmp_path / "ev" / "report.json").read_text())["benchmarks"]
    assert report["toy"]["samples"] == 8


@pytest.mark.parametrize("cli", ["klear-rl", "klear-eval"])
def test_chat_without_a_template_is_a_one_line_error(plain_model, tmp_path, cli, capsys,
                                                     monkeypatch):
    """The console script's function in this process (as tests/multiprocess/test_cli_validation.py runs
    the bad inputs beyond the issue's table): exit 2, one error line, no traceback."""
    from megatron_klear.eval.__main__ import main as eval_main
    from megatron_klear.train.rl import main as rl_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hf, data = plain_model
    command = (_rl(hf, data, tmp_path / "o", "--prompt-template", "chat") if cli == "klear-rl"
               else _eval(hf, data, tmp_path / "o", "--prompt-template", "chat"))
    main = rl_main if cli == "klear-rl" else eval_main
    with pytest.raises(SystemExit) as exit_info:
        main(command[3:])  # the flags after ``python -m MODULE``
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --prompt-template chat: the tokenizer has no chat template; pass "
                      "--chat-template FILE or use --prompt-template raw"]
    assert "Traceback" not in err
