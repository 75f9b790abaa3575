"""LoRA on megatron-core (issue 41), checked against transformers + peft.

One launch of 2 gloo ranks: at TP2 random adapters (non-zero B) are exported as a PEFT folder
and as merged HF weights; at PP2 that folder is imported. The logits of both layouts must
equal those of transformers' Qwen3ForCausalLM with ``peft`` loading the folder (the
reference, computed in the test process), within the conversion tests' tolerance. Then an
SFT step with LoRA at TP2 (frozen base, adapters-only optimizer and checkpoint, bitwise
resume).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_klear.models.tiny import save_tiny_hf_model
from tests.dist import run_distributed

TOL = 1e-4  # tests/test_convert.py's
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # fused layers half targeted


def _cfg(hf: Path, tp: int, pp: int, **kw):
    from megatron_klear.config import TrainConfig

    cfg = TrainConfig(hf_checkpoint=str(hf), tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp, lora_rank=RANK, lora_alpha=ALPHA,
                      lora_target_modules=TARGETS, global_batch_size=4, micro_batch_size=2,
                      lr=1e-2, seed=5, **kw)
    cfg.validate()
    return cfg


def _randomize_b(chunks) -> None:
    """Non-zero B (PEFT initialises it to zero, which would hide any layout error): full
    tensors from a seed per name, split as the model splits them."""
    from megatron.core import parallel_state as ps

    from megatron_klear.models.lora import adapters

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for layer, suffix, adapter in adapters(chunks):
            for part in adapter.targeted:
                b = adapter.lora_B[part]
                out = b.shape[0] * (tp if adapter.column else 1)
                g = torch.Generator().manual_seed(100 * layer + TARGETS.index(part))
                full = torch.randn(out, RANK, generator=g) * 0.3
                b.copy_(full.chunk(tp)[rank] if adapter.column else full)


def _logits(chunks, arch, ids):
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint.convert import megatron_logits

    out = megatron_logits(chunks, arch, ids)
    return out if out is not None and ps.get_tensor_model_parallel_rank() == 0 else None


def _parity(rank, world, hf: Path, out: Path):
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.hf_io import SafetensorsReader, export_model_to_hf
    from megatron_klear.checkpoint.peft_io import export_peft_adapter, load_peft_adapter
    from megatron_klear.models.lora import adapters_disabled, lora_spec
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_model, initialize_parallel

    arch = qwen3_config_from_hf(load_hf_config(hf))
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    res = {}
    for tp, pp in ((2, 1), (1, 2)):
        initialize_parallel(tp, pp)
        cfg = _cfg(hf, tp, pp)
        chunks = [c.eval() for c in build_model(arch, cfg, wrap_ddp=False)]
        load_hf_weights(chunks, arch, SafetensorsReader(str(hf)))
        if tp == 2:
            _randomize_b(chunks)
            export_peft_adapter(chunks, lora_spec(cfg), out / "peft_tp2", base_model=str(hf))
            export_model_to_hf(chunks, arch, out / "merged_tp2")
        else:  # PP2 imports what TP2 exported, and exports it again
            load_peft_adapter(chunks, lora_spec(cfg), out / "peft_tp2")
            export_peft_adapter(chunks, lora_spec(cfg), out / "peft_pp2")
        res[f"tp{tp}pp{pp}"] = _logits(chunks, arch, ids)
        with adapters_disabled(chunks):
            res[f"tp{tp}pp{pp}_off"] = _logits(chunks, arch, ids)
    res["ids"] = ids
    return res


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = save_tiny_hf_model(root / "hf", std=0.2, seed=2)
    ranks = run_distributed(_parity, 2, hf, root)
    got = {k: v for r in ranks for k, v in r.items() if v is not None}
    return got, hf, root


def _peft_logits(hf: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                 attn_implementation="eager")
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_logits_equal_transformers_with_peft(parity, layout):
    from megatron_klear.checkpoint.convert import hf_logits

    got, hf, root = parity
    ref = _peft_logits(hf, root / "peft_tp2", got["ids"])
    diff = (got[layout] - ref).abs().max().item()
    print(f"{layout}: max |megatron+LoRA - transformers+peft| = {diff:.3g}")
    assert diff < TOL
    # the adapters matter (non-zero B): the base alone is far off, and equals transformers'
    assert (hf_logits(hf, got["ids"]) - ref).abs().max().item() > 100 * TOL
    assert (got[f"{layout}_off"] - hf_logits(hf, got["ids"])).abs().max().item() < TOL


def test_peft_folder_has_peft_names_and_round_trips_bitwise(parity):
    _, _, root = parity
    cfg = json.loads((root / "peft_tp2" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", RANK, ALPHA)
    tp2 = load_file(root / "peft_tp2" / "adapter_model.safetensors")
    pp2 = load_file(root / "peft_pp2" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in tp2
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in tp2
    assert not any("k_proj" in n or "gate_proj" in n for n in tp2)  # not targeted
    assert tp2.keys() == pp2.keys() and all(torch.equal(tp2[n], pp2[n]) for n in tp2)


def test_merged_export_equals_peft(parity):
    from megatron_klear.checkpoint.convert import hf_logits

    got, hf, root = parity
    ref = _peft_logits(hf, root / "peft_tp2", got["ids"])
    assert (hf_logits(root / "merged_tp2", got["ids"]) - ref).abs().max().item() < TOL
