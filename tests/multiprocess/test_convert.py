"""HF <-> Megatron conversion of Qwen3 (issue 3), checked against transformers' Qwen3.

Tiny random models (std 0.2, random norm weights, vocab 103 -- not a multiple of 128),
tied and untied. Each spawned launch groups several checks (imports cost ~5 s a launch).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_klear.checkpoint.convert import ConversionError, convert_hf_to_megatron
from megatron_klear.checkpoint.hf_bridge import BridgeError
from megatron_klear.models.qwen3 import ConfigError
from megatron_klear.models.tiny import save_tiny_hf_model
from tests.dist import run_distributed

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
TIES = (False, True)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {tie: save_tiny_hf_model(root / f"tie{int(tie)}", seed=int(tie), std=0.2,
                                    tie_word_embeddings=tie) for tie in TIES}


# Source dtypes for the default-flags round trip: the fp32 fixture as saved, an fp16 copy
# (config says float16), and a bf16 copy whose config names no dtype (the tensors decide).
DTYPE_CASES = {"fp32": (None, "float32"), "fp16": (torch.float16, "float16"),
               "bf16_no_config_dtype": (torch.bfloat16, None)}


def _recast(hf: Path, out: Path, dtype: torch.dtype | None, config_dtype: str | None) -> Path:
    shutil.copytree(hf, out)
    if dtype is not None:
        tensors = {n: t.to(dtype) for n, t in load_file(out / "model.safetensors").items()}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    if config_dtype is not None:
        cfg["torch_dtype"] = config_dtype
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------- one rank
def _one_rank(rank, world, hf_dirs, out: Path):
    from megatron_klear.checkpoint import convert, hf_bridge, state
    from megatron_klear.models import qwen3

    res = {}
    for tie, hf in hf_dirs.items():
        ckpt = convert.convert_hf_to_megatron(hf, out / f"mg{int(tie)}", dtype="fp32")
        res["tp1", tie] = convert.compare_logits(hf, ckpt)
        back = convert.convert_megatron_to_hf(ckpt, out / f"back{int(tie)}", hf_config_dir=hf,
                                              max_shard_bytes=200_000)  # several shards
        res["back", tie] = back
        # Negative control: a plain cat(q, k, v) instead of the per-group interleave.
        arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(hf))
        model = convert.build_model(arch)
        hf_bridge.load_hf_weights([model], arch, _hf_tensors(hf))
        sd = _hf_tensors(hf)
        with torch.no_grad():
            for i, layer in enumerate(model.decoder.layers):
                p = f"model.layers.{i}.self_attn."
                layer.self_attention.linear_qkv.weight.copy_(torch.cat(
                    [sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]]))
        state.save_checkpoint(out / f"wrong{int(tie)}", 0, [model], hf_config=arch.hf_config)
        res["wrong_qkv", tie] = convert.compare_logits(hf, out / f"wrong{int(tie)}")
    # Several shards, with every layer's q/k/v and gate/up spread over different files.
    sharded = _reshard_round_robin(hf_dirs[False], out / "hf_sharded", n=3)
    ckpt = convert.convert_hf_to_megatron(sharded, out / "mg_sharded", dtype="fp32")
    res["sharded_input"] = convert.compare_logits(hf_dirs[False], ckpt)
    # Default flags (dtype auto) both ways, for each source dtype.
    for case, (dtype, config_dtype) in DTYPE_CASES.items():
        src = _recast(hf_dirs[True], out / f"src_{case}", dtype, config_dtype)
        mg = convert.convert_hf_to_megatron(src, out / f"mg_{case}")
        back = convert.convert_megatron_to_hf(mg, out / f"back_{case}", max_shard_bytes=100_000)
        meta = state.read_meta(state.find_latest_checkpoint(mg))
        res["dtype", case] = (str(src), str(back), meta["params_dtype"])
    return res


def _reshard_round_robin(hf: Path, out: Path, n: int) -> Path:
    shutil.copytree(hf, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    for k in range(n):
        save_file({name: t for i, (name, t) in enumerate(sorted(tensors.items())) if i % n == k},
                  out / f"model-{k + 1:05d}-of-{n:05d}.safetensors")
    return out


@pytest.fixture(scope="module")
def single(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return run_distributed(_one_rank, 1, hf_dirs, out)[0], out


@pytest.mark.parametrize("tie", TIES)
def test_tp1_logits_match_transformers(single, tie):
    assert single[0]["tp1", tie] < TOL


def test_input_sharded_across_files_converts_exactly(single):
    assert single[0]["sharded_input"] < TOL


@pytest.mark.parametrize("tie", TIES)
def test_wrong_qkv_grouping_is_caught_by_the_parity_check(single, tie):
    assert single[0]["wrong_qkv", tie] > 100 * TOL


@pytest.mark.parametrize("case", sorted(DTYPE_CASES))
def test_default_flags_keep_the_source_dtype_and_round_trip_bitwise(single, case):
    src, back, params_dtype = single[0]["dtype", case]
    original, returned = _hf_tensors(Path(src)), _hf_tensors(Path(back))
    want = {"fp32": torch.float32, "fp16": torch.float16, "bf16_no_config_dtype": torch.bfloat16}
    assert params_dtype == str(want[case]).replace("torch.", "")
    assert {t.dtype for t in original.values()} == {want[case]}
    assert set(returned) == set(original)
    assert [n for n in original if original[n].dtype != returned[n].dtype
            or not torch.equal(original[n], returned[n])] == []
    assert json.loads((Path(back) / "config.json").read_text())["torch_dtype"] == params_dtype


@pytest.mark.parametrize("tie", TIES)
def test_hf_megatron_hf_round_trip_is_bitwise(single, hf_dirs, tie):
    back = Path(single[0]["back", tie])
    original, returned = _hf_tensors(hf_dirs[tie]), _hf_tensors(back)
    assert set(returned) == set(original)
    assert [n for n in original if not torch.equal(original[n], returned[n])] == []
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert all((back / f).is_file() for f in set(index["weight_map"].values()))
    config = json.loads((back / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie and config["vocab_size"] == 103
    assert (back / "tokenizer.json").is_file()
    assert not list(back.parent.glob(".*.tmp"))


# ---------------------------------------------------------------- two ranks
def _layout_logits(arch, ckpt, tp, pp, ids):
    from megatron_klear.checkpoint import convert, state
    from megatron_klear.distributed import initialize_parallel

    initialize_parallel(tp, pp)  # TP1/PP1 on 2 ranks = 2 data-parallel replicas
    model = convert.build_model(arch)
    state.load_checkpoint(ckpt, [model], load_rng=False)
    return convert.megatron_logits(model, arch, ids), model


def _two_ranks(rank, world, hf_dirs, single_out: Path, out: Path):
    from megatron_klear.checkpoint import convert, hf_bridge, hf_io, state
    from megatron_klear.models import qwen3

    res = {}
    for tie, hf in hf_dirs.items():
        tp1_ckpt = single_out / f"mg{int(tie)}"
        res["tp2", tie] = convert.compare_logits(hf, tp1_ckpt, tp=2)
        res["pp2", tie] = convert.compare_logits(hf, tp1_ckpt, pp=2)
        tp2_ckpt = convert.convert_hf_to_megatron(hf, out / f"tp2_{int(tie)}", tp=2, dtype="fp32")
        it = state.find_latest_checkpoint(tp2_ckpt)
        res["split", tie] = (state.read_meta(it)["world_size"],
                             sorted({p.name.split("_")[2] for p in it.glob("__*.distcp")}))
        arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(hf))
        ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        ref = convert.hf_logits(hf, ids)
        logits = {}
        for tp, pp in ((2, 1), (1, 2), (1, 1)):
            logits[tp, pp], model = _layout_logits(arch, tp2_ckpt, tp, pp, ids)
            if (tp, pp) in ((2, 1), (1, 2)):  # a live model's HF export (the trainers')
                d = hf_io.export_model_to_hf([model], arch, out / f"live_{tp}{pp}_{int(tie)}",
                                             tokenizer_dir=hf)
                returned, original = _hf_tensors(d), _hf_tensors(hf)
                res["live", tp, pp, tie] = (set(returned) == set(original) and all(
                    torch.equal(returned[n], original[n]) for n in original),
                    len(list(d.glob("*.safetensors"))), (d / "tokenizer.json").is_file())
            if (tp, pp) == (2, 1):  # weight-sync export: full tensors on every TP rank
                exported = hf_bridge.hf_state_dict_from_megatron([model], arch)
                original = _hf_tensors(hf)
                res["export_tp2", tie, rank] = sorted(
                    n for n in original if n not in exported or not torch.equal(exported[n],
                                                                                original[n]))
                # megatron's own writer at TP2 (chunks split over ranks), converted back by
                # both ranks (shards split between them)
                state.save_checkpoint(out / f"saved_tp2_{int(tie)}", 1, [model],
                                      hf_config=arch.hf_config)
                back = convert.convert_megatron_to_hf(out / f"saved_tp2_{int(tie)}",
                                                      out / f"back_tp2_{int(tie)}",
                                                      hf_config_dir=hf, max_shard_bytes=100_000)
                returned = _hf_tensors(back)
                res["back_tp2", tie] = (set(returned) == set(original) and all(
                    torch.equal(returned[n], original[n]) for n in original),
                    len(list(back.glob("*.safetensors"))))
            if (tp, pp) == (1, 2):  # PP: each stage exports its own layers, global indices
                res["export_pp2", tie, rank] = sorted(
                    n for n, _ in hf_bridge.export_hf_weights([model], arch))
        if rank == 1:  # the last stage at every layout
            res["layouts", tie] = max((logits[k] - ref).abs().max().item() for k in logits)
            res["layout_spread", tie] = max((logits[k] - logits[2, 1]).abs().max().item()
                                            for k in logits)
    return res


@pytest.fixture(scope="module")
def double(hf_dirs, single, tmp_path_factory):
    out = tmp_path_factory.mktemp("double")
    ranks = run_distributed(_two_ranks, 2, hf_dirs, single[1], out)
    return {**ranks[0], **ranks[1]}


@pytest.mark.parametrize("tie", TIES)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tp2_and_pp2_logits_match_transformers(double, layout, tie):
    assert double[layout, tie] < TOL


@pytest.mark.parametrize("tie", TIES)
def test_checkpoint_converted_by_two_ranks_loads_at_tp2_pp2_and_tp1(double, tie):
    assert double["split", tie] == (2, ["0", "1"])  # both ranks wrote their share
    assert double["layouts", tie] < TOL
    assert double["layout_spread", tie] < 1e-5


@pytest.mark.parametrize("tie", TIES)
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_live_model_export_is_bitwise(double, tie, layout):
    same, shards, tokenizer = double["live", *layout, tie]
    assert same and tokenizer
    assert shards == layout[1]  # one shard per pipeline stage


@pytest.mark.parametrize("tie", TIES)
def test_tp2_training_checkpoint_converts_back_bitwise_on_two_ranks(double, tie):
    same, shards = double["back_tp2", tie]
    assert same and shards > 2


@pytest.mark.parametrize("tie", TIES)
def test_export_gathers_full_tensors_on_every_tp_rank(double, tie):
    assert double["export_tp2", tie, 0] == [] and double["export_tp2", tie, 1] == []


@pytest.mark.parametrize("tie", TIES)
def test_export_at_pp2_yields_each_stages_layers_with_global_indices(double, tie):
    first, last = double["export_pp2", tie, 0], double["export_pp2", tie, 1]
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"1"}
    assert ("lm_head.weight" in last) is (not tie)
    assert len(first) + len(last) == 3 + 11 * 2 - tie


# ---------------------------------------------------------------- four ranks
def _four_ranks(rank, world, hf_dirs, single_out: Path):
    from megatron_klear.checkpoint import convert

    return {tie: convert.compare_logits(hf, single_out / f"mg{int(tie)}", tp=2, pp=2)
            for tie, hf in hf_dirs.items()}


def test_tp2xpp2_logits_match_transformers(hf_dirs, single):
    diffs = run_distributed(_four_ranks, 4, hf_dirs, single[1])[0]
    assert max(diffs.values()) < TOL, diffs


# ---------------------------------------------------------------- CLIs
def _cli(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}"])
    return subprocess.run(launcher + [str(REPO / "tools" / args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=240, cwd=REPO)


def test_clis_convert_both_ways_and_gate_on_parity(hf_dirs, tmp_path):
    hf, other = str(hf_dirs[False]), str(hf_dirs[True])
    mg, back = str(tmp_path / "mg"), str(tmp_path / "back")
    r = _cli("convert_hf_to_megatron.py", "--hf-dir", hf, "--out-dir", mg, "--dtype", "fp32",
             "--tp", "2", nproc=2)
    assert r.returncode == 0, r.stderr
    r = _cli("compare_logits.py", "--hf-dir", hf, "--megatron-dir", mg, "--pp", "2", nproc=2)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    # Negative control: the reference is a different model -> exit 1.
    r = _cli("compare_logits.py", "--hf-dir", other, "--megatron-dir", mg, "--tp", "2", nproc=2)
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr
    r = _cli("convert_megatron_to_hf.py", "--load", mg, "--out-dir", back, "--hf-config", hf,
             "--max-shard-size-gb", "0.0001", nproc=2)
    assert r.returncode == 0, r.stderr
    original, returned = _hf_tensors(Path(hf)), _hf_tensors(Path(back))
    assert set(original) == set(returned)
    assert all(torch.equal(original[n], returned[n]) for n in original)
    r = _cli("convert_megatron_to_hf.py", "--load", mg, "--out-dir", back)
    assert r.returncode == 2 and "--out-dir" in r.stderr and "--overwrite" in r.stderr


# ---------------------------------------------------------------- bad input
def _edit_tensors(hf: Path, edit) -> None:
    path = hf / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_config(hf: Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


BAD_INPUTS = {
    "missing": (lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                {}, BridgeError, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "unexpected": (lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.layers.0.self_attn.rotary.weight": torch.zeros(2)})),
        {}, BridgeError, "unexpected tensor 'model.layers.0.self_attn.rotary.weight'"),
    "shape": (lambda d: _edit_config(d, intermediate_size=96), {}, BridgeError,
              r"shape mismatch for tensor 'model.layers.0.mlp.down_proj.weight'"),
    "architecture": (lambda d: _edit_config(d, model_type="qwen2_moe",
                                            architectures=["Qwen2MoeForCausalLM"]),
                     {}, ConfigError, "model_type='qwen2_moe'.*supported: Qwen3"),
    "tp": (lambda d: None, {"tp": 3}, ConversionError, "--tp 3.*num_attention_heads"),
    "pp": (lambda d: None, {"pp": 4}, ConversionError, "--pp 4.*num_hidden_layers"),
    "dtype": (lambda d: None, {"dtype": "int8"}, ConversionError, "--dtype 'int8'"),
    "threads": (lambda d: None, {"threads": 0}, ConversionError, "--threads 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_the_problem_and_writes_nothing(hf_dirs, tmp_path, case):
    edit, kwargs, error, match = BAD_INPUTS[case]
    hf = Path(shutil.copytree(hf_dirs[False], tmp_path / "hf"))
    edit(hf)
    with pytest.raises(error, match=match):
        convert_hf_to_megatron(hf, tmp_path / "out", **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_existing_out_dir_needs_overwrite(hf_dirs, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="--out-dir .* already exists; pass --overwrite"):
        convert_hf_to_megatron(hf_dirs[False], tmp_path / "out")
