"""LoRA adapters of a live model as a PEFT adapter folder, and back (issue 41).

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's
names, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (r x in) and
``...lora_B.weight`` (out x r); ``peft.PeftModel.from_pretrained`` loads it onto the HF model.
The adapters of each megatron layer are split like its base weight
(:mod:`megatron_klear.models.lora`): export gathers the split ones over TP (column-parallel
``B`` on dim 0, row-parallel ``A`` on dim 1) and every pipeline stage's over the world;
import takes this rank's shard of each full tensor. Merged full weights go through the
ordinary HF export (:func:`~megatron_klear.checkpoint.hf_io.export_model_to_hf`), which merges
``W + scale B A`` layer by layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import load_file, save_file

from megatron_klear.checkpoint.hf_io import ConversionError, publish_dir, tmp_dir
from megatron_klear.config import PEFT_ADAPTER_CONFIG as ADAPTER_CONFIG
from megatron_klear.config import PEFT_ADAPTER_WEIGHTS as ADAPTER_WEIGHTS
from megatron_klear.models.lora import LoraSpec, adapters, hf_module

__all__ = ["export_peft_adapter", "load_peft_adapter", "peft_name", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]


def peft_name(layer: int, part: str, matrix: str) -> str:
    """PEFT's name of an adapter matrix (``matrix``: ``lora_A`` or ``lora_B``)."""
    return f"base_model.model.model.layers.{layer}.{hf_module(part)}.{matrix}.weight"


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard (concatenated on ``dim``)."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _stage_tensors(model_chunks) -> dict[str, torch.Tensor]:
    """This stage's full adapters by PEFT name (collective over TP)."""
    out = {}
    for layer, _, adapter in adapters(model_chunks):
        for part in adapter.targeted:
            a, b = adapter.lora_A[part], adapter.lora_B[part]
            out[peft_name(layer, part, "lora_A")] = a.detach().clone() if adapter.column \
                else _gather(a, 1)
            out[peft_name(layer, part, "lora_B")] = _gather(b, 0) if adapter.column \
                else b.detach().clone()
    return out


def export_peft_adapter(model_chunks, spec: LoraSpec, out_dir: str | Path, *,
                        base_model: str | None = None) -> Path:
    """Write the adapters as a PEFT LoRA folder (collective; any TP/PP). Rank 0 writes."""
    tensors = {n: t.cpu() for n, t in _stage_tensors(model_chunks).items()}
    held: list = [None] * dist.get_world_size()
    mine = tensors if ps.get_tensor_model_parallel_rank() == 0 and \
        ps.get_data_parallel_rank() == 0 else {}
    dist.all_gather_object(held, mine)  # adapters are small: a few MB per layer at most
    out_dir = Path(out_dir)
    if dist.get_rank() == 0:
        tmp = tmp_dir(out_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for part in held for n, t in part.items()},
                  tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(_peft_config(spec, base_model), indent=2))
        publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


def _peft_config(spec: LoraSpec, base_model: str | None) -> dict:
    """PEFT's LoraConfig fields of ``spec`` (others take PEFT's defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.targets), "bias": "none", "use_rslora": False,
            "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "base_model_name_or_path": base_model,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


@torch.no_grad()
def load_peft_adapter(model_chunks, spec: LoraSpec, adapter_dir: str | Path) -> None:
    """Fill the model's adapters from a PEFT LoRA folder (this rank's shards). Raises
    :class:`ConversionError` naming the file and field when its rank, alpha or targets differ
    from the run's flags, or a tensor is missing or mis-shaped."""
    adapter_dir = Path(adapter_dir)
    cfg_path, weights = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    for f in (cfg_path, weights):
        if not f.is_file():
            raise ConversionError(f"{f}: missing; a PEFT LoRA folder holds {ADAPTER_CONFIG} and "
                                  f"{ADAPTER_WEIGHTS}")
    cfg = json.loads(cfg_path.read_text())
    saved = {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"),
             "target_modules": sorted(cfg.get("target_modules") or [])}
    want = {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": sorted(spec.targets)}
    for key, flag in (("r", "--lora-rank"), ("lora_alpha", "--lora-alpha"),
                      ("target_modules", "--lora-target-modules")):
        if saved[key] != want[key] and not (key == "lora_alpha" and
                                            float(saved[key] or 0) == want[key]):
            raise ConversionError(f"{cfg_path}: {key} {saved[key]} but {flag} {want[key]}; "
                                  f"pass {flag} as the adapter was trained")
    tensors = load_file(weights)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for layer, _, adapter in adapters(model_chunks):
        for part in adapter.targeted:
            for matrix, param in (("lora_A", adapter.lora_A[part]),
                                  ("lora_B", adapter.lora_B[part])):
                name = peft_name(layer, part, matrix)
                if name not in tensors:
                    raise ConversionError(f"{weights}: missing tensor {name!r}")
                full = tensors[name]
                split = (matrix == "lora_B") == adapter.column
                shard = full.chunk(tp, dim=0 if adapter.column else 1)[rank] if split else full
                if shard.shape != param.shape:
                    raise ConversionError(f"{weights}: {name!r} has shape {tuple(full.shape)}, "
                                          f"the model's adapter needs {_full_shape(param, split, adapter, tp)}")
                param.copy_(shard)


def _full_shape(param, split: bool, adapter, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if split:
        shape[0 if adapter.column else 1] *= tp
    return tuple(shape)
