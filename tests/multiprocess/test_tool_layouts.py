"""The tools take the trainer's layout flags from one definition (issue 28): compare_logits at
an uneven PP=2 split of a 3-layer tied-embedding model, the converters and klear-eval."""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_klear.config import (LAYOUT_FIELDS, TrainConfig, _build_parser, add_layout_flags,
                                   layout_from_args)

REPO = Path(__file__).resolve().parents[2]
UNEVEN = ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"]


def _tool(name: str, *args, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([*launcher, str(REPO / "tools" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("layouts")
    hf = save_tiny_hf_model(root / "hf", seed=1, std=0.2, num_hidden_layers=3,
                            tie_word_embeddings=True)
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", hf, "--out-dir", root / "mg", "--dtype",
              "fp32", *UNEVEN)  # the converter checks the split too
    assert r.returncode == 0, r.stderr[-2000:]
    return hf, root / "mg"


def test_compare_logits_at_an_uneven_pp2_split_of_three_layers(three_layers):
    hf, mg = three_layers
    r = _tool("compare_logits.py", "--hf-dir", hf, "--megatron-dir", mg, "--tp", "1", *UNEVEN,
              nproc=2)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_layouts_that_cannot_split_the_model_are_refused_by_name(three_layers, tmp_path):
    from megatron_klear.checkpoint.convert import (ConversionError, _check_layout,
                                                   convert_megatron_to_hf)
    from megatron_klear.config import parallel_layout
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf

    hf, mg = three_layers
    arch = qwen3_config_from_hf(load_hf_config(hf))
    # what compare_logits --pp 2 said before it had the split flags, and still says without
    with pytest.raises(ConversionError, match="--pipeline-model-parallel-size 2 does not divide "
                       "num_hidden_layers=3; set --decoder-first-pipeline-num-layers"):
        _check_layout(arch, parallel_layout(pipeline_model_parallel_size=2))
    assert _check_layout(arch, parallel_layout(pipeline_model_parallel_size=2,
                                               decoder_first_pipeline_num_layers=1)
                         ).stage_layers == (1, 2)
    with pytest.raises(ConversionError, match="with --decoder-last-pipeline-num-layers 3, 0 of num_hidden_layers=3 remain"):
        convert_megatron_to_hf(mg, tmp_path / "out", layout=parallel_layout(
            pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=3))


def _tool_parser(tool: str) -> argparse.ArgumentParser:
    if tool == "klear-eval":
        from megatron_klear.eval.__main__ import build_parser

        return build_parser()
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module(tool).build_parser()
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.mark.parametrize("tool", ["compare_logits", "convert_hf_to_megatron",
                                  "convert_megatron_to_hf", "klear-eval"])
def test_every_tool_takes_the_trainers_layout_flags(tool):
    parser = _tool_parser(tool)
    trainer = {a.dest: a for a in _build_parser(TrainConfig, None)._actions}
    mine = {a.dest: a for a in parser._actions}
    for name in LAYOUT_FIELDS:  # same flag, type and help as the trainer's
        assert trainer[name].option_strings[0] in mine[name].option_strings, (tool, name)
        assert (mine[name].type, mine[name].help) == (trainer[name].type, trainer[name].help)
    argv = ["--tp", "2", "--pp", "4", "--decoder-last-pipeline-num-layers", "3",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    argv += [x for a in parser._actions if a.required for x in (a.option_strings[0], "x")]
    layout = layout_from_args(parser.parse_args(argv))
    assert (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
            layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers,
            layout.expert_model_parallel_size, layout.expert_tp) == (2, 4, None, 3, 2, 1)


def test_add_layout_flags_defaults_are_the_trainers():
    parser = argparse.ArgumentParser()
    add_layout_flags(parser)
    assert layout_from_args(parser.parse_args([])) == TrainConfig()
