"""Converter checkpoints and Transformer Engine models (issue 30, defect 3), dense and MoE.

Transformer Engine is not installed here, so the TE model is a stand-in: the local-spec model
whose q/k norms, final norm and MoE pre-MLP norms carry extra state the way TE's do, and whose
MoE layers keep ``pre_mlp_layernorm.weight`` under its own name as TE's MoE layers do. One
launch per model kind: the converter's checkpoint loads into it (megatron's load is strict
on missing keys: before the fix, "Missing key" for the norms' ``_extra_state``), its logits
equal transformers', and its own checkpoint converts back to the HF tensors bitwise.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_klear.models.norms import RMSNorm
from tests.dist import run_distributed


class TEStyleRMSNorm(RMSNorm):
    """Stands in for Transformer Engine's ``te.pytorch.RMSNorm``
    (transformer_engine/pytorch/module/rmsnorm.py, an ``ops.RMSNorm``): the same weight,
    plus the extra state TE saves (transformer_engine/pytorch/ops/op.py ``get_extra_state``:
    an empty uint8 tensor when no FP8 recipe state exists; ``set_extra_state`` skips an empty
    one and would unpickle recipe state otherwise)."""

    def get_extra_state(self) -> torch.Tensor:  # noqa: D102
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:  # noqa: D102
        if state is not None and state.numel():
            raise ValueError("TE stand-in: FP8 recipe state is not expected here")


def te_style(model: torch.nn.Module) -> torch.nn.Module:
    """The local-spec model with TE's checkpoint layout (see the module docstring)."""
    for layer in model.decoder.layers:
        for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
            norm.__class__ = TEStyleRMSNorm
        if hasattr(layer.mlp, "router"):  # a MoE layer: TENorm, no fused-name mapping
            layer.pre_mlp_layernorm.__class__ = TEStyleRMSNorm
            keys = {k: v for k, v in layer.submodules_config.sharded_state_dict_keys_map.items()
                    if not k.startswith("pre_mlp_layernorm")}
            layer.submodules_config = dataclasses.replace(layer.submodules_config,
                                                          sharded_state_dict_keys_map=keys)
    model.decoder.final_layernorm.__class__ = TEStyleRMSNorm
    return model


def _both(rank, world, tmp: str) -> dict:
    """Dense and MoE in one launch (one process start, one set of imports)."""
    from megatron_klear.models.tiny import save_tiny_hf_model

    out = {}
    for kind in ("dense", "moe"):
        hf = save_tiny_hf_model(f"{tmp}/{kind}/hf", std=0.2, moe=kind == "moe",
                                with_tokenizer=False)
        out[kind] = _round_trip(str(hf), f"{tmp}/{kind}")
    return out


def _round_trip(hf_dir: str, tmp: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_klear.checkpoint.convert import (build_model, convert_hf_to_megatron,
                                                   convert_megatron_to_hf, hf_logits,
                                                   megatron_logits)
    from megatron_klear.checkpoint.state import (find_latest_checkpoint, load_checkpoint,
                                                 save_checkpoint)
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.distributed import initialize_parallel

    convert_hf_to_megatron(hf_dir, f"{tmp}/converted")
    hf_config = load_hf_config(hf_dir)
    arch = qwen3_config_from_hf(hf_config)
    initialize_parallel(1, 1)
    model = te_style(build_model(arch, torch.float32))
    load_checkpoint(f"{tmp}/converted", [model], load_rng=False)
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    diff = float((megatron_logits(model, arch, ids) - hf_logits(hf_dir, ids)).abs().max())
    save_checkpoint(f"{tmp}/te", 1, [model], hf_config=hf_config)
    keys = set(FileSystemReader(str(find_latest_checkpoint(f"{tmp}/te")))
               .read_metadata().state_dict_metadata)
    convert_megatron_to_hf(f"{tmp}/te", f"{tmp}/back")
    src, back = {}, {}
    for d, out in ((hf_dir, src), (f"{tmp}/back", back)):
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(str(f)))
    return {"logit_diff": diff, "keys": sorted(keys),
            "equal": sorted(src) == sorted(back) and all(torch.equal(src[k], back[k])
                                                         for k in src)}


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> dict:
    return run_distributed(_both, 1, str(tmp_path_factory.mktemp("te")))[0]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_converter_checkpoint_loads_into_te_layout_and_back(round_trips, kind):
    moe = kind == "moe"
    got = round_trips[kind]
    assert got["logit_diff"] < 1e-4
    assert got["equal"]  # the TE-layout checkpoint converts back to the HF tensors
    keys = got["keys"]
    assert "decoder.final_layernorm._extra_state/shard_0_1" in keys
    for norm in ("q_layernorm", "k_layernorm"):
        assert any(f"self_attention.{norm}._extra_state" in k for k in keys)
    # the stand-in saved its MoE layers' norm under TE's name, which the converter read back
    assert any("pre_mlp_layernorm.weight" in k for k in keys) == moe
