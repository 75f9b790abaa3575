"""Adapters made by ``peft`` itself (issue 56): ``--lora-load DIR`` starts klear-sft and klear-rl
from a PEFT LoRA folder, and ``tools/compare_logits.py`` checks megatron-with-adapters against
transformers + ``peft``.

The adapter is ``get_peft_model`` on the tiny HF Qwen3 with random non-zero A and B (PEFT's
zero B would hide any layout error), saved with ``save_pretrained``. Its r, alpha and targets
reach the runs through adapter_config.json alone (no --lora-rank given).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.multiprocess.test_rl import _rl_args, hf_model, prompts  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4  # the conversion tests' tolerance
RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # fused layers half targeted
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def adapter(hf_model, tmp_path_factory) -> Path:
    """A PEFT LoRA folder written by peft itself, with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_model), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    out = tmp_path_factory.mktemp("peft") / "adapter"
    peft.save_pretrained(str(out))
    return out


def _tool(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}"])
    return subprocess.run(launcher + [str(REPO / "tools" / "compare_logits.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)


def _diff(r: subprocess.CompletedProcess) -> float:
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
    return float(re.search(r"max_abs_logit_diff=(\S+)", r.stdout).group(1))


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_compare_logits_of_a_peft_adapter_equal_peft(hf_model, adapter, layout):
    """tools/compare_logits.py imports peft's folder at TP2 / PP2 onto --hf-dir's weights:
    Megatron's logits equal transformers + peft's within the conversion tolerance."""
    from megatron_klear.checkpoint.convert import hf_logits

    diff = _diff(_tool("--hf-dir", str(hf_model), "--lora-load", str(adapter), *layout,
                       nproc=2))
    print(f"{layout}: max |megatron + peft adapter - transformers + peft| = {diff:.3g}")
    assert diff < TOL
    # the adapters matter: transformers without them is far from transformers with them
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    assert (hf_logits(hf_model, ids) - hf_logits(hf_model, ids, adapter)).abs().max() > 100 * TOL


def test_lora_flags_that_differ_from_the_adapter_are_refused_by_name(hf_model, adapter,
                                                                      tmp_path, capsys,
                                                                      monkeypatch):
    """A flag given against adapter_config.json, and an adapter PEFT builds otherwise (DoRA),
    exit 2 naming the flag or field, in the tool and in klear-sft's --dry-run (its main, in
    this process)."""
    from megatron_klear.train.sft import main

    r = _tool("--hf-dir", str(hf_model), "--lora-load", str(adapter), "--lora-alpha", "16")
    assert r.returncode == 2 and "--lora-alpha 16.0 but --lora-load" in r.stderr, r.stderr
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    for folder, extra, want in ((adapter, ("--lora-rank", "8"), "--lora-rank 8 but"),
                                (adapter, ("--lora-target-modules", "q_proj"),
                                 "--lora-target-modules ['q_proj'] but"),
                                (dora, (), "use_dora True is not supported"),
                                (dora.parent, (), "cannot read")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--hf-checkpoint", str(hf_model), "--data-path", str(tmp_path / "x.jsonl"),
                  "--lora-load", str(folder), *extra, "--dry-run"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and want in err, err


@pytest.fixture(scope="module")
def sft_run(hf_model, adapter, tmp_path_factory):
    """klear-sft from the PEFT folder (no LoRA flag but --lora-load), 1 step at --lr 0 so
    the adapters it saves must be peft's exactly."""
    from megatron_klear.data.synthetic import write_arithmetic_data

    root = tmp_path_factory.mktemp("sft_lora_load")
    data = write_arithmetic_data(root / "data", n_sft=16, n_rl=2, n_eval=2)["sft"]
    save = root / "ck"
    r = subprocess.run([sys.executable, "-m", "megatron_klear.train.sft", "--hf-checkpoint",
                        str(hf_model), "--data-path", str(data), "--save", str(save),
                        "--lora-load", str(adapter), "--train-iters", "1", "--lr", "0",
                        "--seq-length", "128", "--micro-batch-size", "2",
                        "--global-batch-size", "2", "--no-progress-bar",
                        "--export-hf", str(root / "export")],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_sft_starts_from_the_peft_adapter(sft_run, adapter):
    from megatron_klear.checkpoint.state import find_latest_checkpoint, read_meta

    meta = read_meta(find_latest_checkpoint(sft_run / "ck"))
    assert meta["lora"]
    exported = sft_run / "export" / "peft_adapter"
    cfg = json.loads((exported / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == \
        (RANK, ALPHA, sorted(TARGETS))  # from the adapter's config alone
    want, got = load_file(adapter / "adapter_model.safetensors"), \
        load_file(exported / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for name, t in want.items():  # --lr 0: the run holds peft's adapters, bitwise
        assert torch.equal(got[name], t), name


def test_compare_logits_of_an_adapters_only_checkpoint_equal_peft(hf_model, sft_run):
    """The CLI check of a LoRA run's adapters-only checkpoint: its adapters on --hf-dir's
    weights against transformers + peft with them exported."""
    diff = _diff(_tool("--hf-dir", str(hf_model), "--megatron-dir", str(sft_run / "ck"),
                       "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                       "--lora-target-modules", *TARGETS))
    assert diff < TOL


def test_rl_starts_from_the_peft_adapter(hf_model, prompts, adapter, tmp_path):  # noqa: F811
    """klear-rl from the PEFT folder at --lr 0: its KL reference is the base (adapters off),
    so the KL is non-zero only if the run holds peft's adapters (fresh adapters, B zero, are
    the base itself: KL 0)."""
    from megatron_klear.train.metrics import read_metrics

    r = subprocess.run([sys.executable, "-m", "megatron_klear.train.rl",
                        *_rl_args(hf_model, prompts, tmp_path / "rl", 1, "--lora-load",
                                  str(adapter), "--kl-coef", "0.01", "--max-sampling-rounds",
                                  "8", "--lr", "0")],
                       capture_output=True, text=True, timeout=400, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    (step,) = read_metrics(tmp_path / "rl" / "metrics.jsonl")
    print(f"step 1: KL against the base {step['train/kl']:.3g}")
    assert step["train/kl"] > 1e-3, step["train/kl"]
    assert step["weight_sync/probe_max_abs_diff"] < 1e-3  # the servers got the merged adapter
