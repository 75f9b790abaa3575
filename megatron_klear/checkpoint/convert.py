"""Hugging Face <-> Megatron conversion and the logit parity check behind the tools/ CLIs.

Both converters stream: no model is materialised. A meta-device GPTModel supplies
megatron-core's checkpoint layout, :mod:`~megatron_klear.checkpoint.hf_bridge` the mapping,
and tensors go from file to file one at a time (see ``docs/conversion.md``):

* :func:`convert_hf_to_megatron` copies the HF tensors' bytes into the checkpoint records
  of the Megatron parameters made from them, into iteration 0 of a ``torch_dist``
  training checkpoint (model only) that loads at any TP/PP layout; ``--load`` of a
  trainer starts from it.
* :func:`convert_megatron_to_hf` plans the safetensors shards from config.json, then fills
  each shard parameter by parameter from the checkpoint (saved at any TP/PP layout).
* Under ``torchrun --nproc-per-node N`` the work splits N ways (checkpoint chunks by rank,
  HF shards by rank); each process also writes ``threads`` files concurrently.
* ``dtype="auto"`` keeps the source's dtype (config ``torch_dtype``/``dtype``, else the
  tensors' own; the checkpoint's ``params_dtype`` the other way).
* :func:`compare_logits` runs transformers' Qwen3 (fp32, eager) and the Megatron model
  at a TP/PP layout on the same token ids and returns the max absolute logit difference.

Every output is written to a temp dir next to the target and renamed at the end.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_klear import platform
from megatron_klear.checkpoint import hf_bridge, torch_dist_io
from megatron_klear.checkpoint.hf_io import (ConversionError, SafetensorsReader, ShardPlan,
                                             ShardWriter, byte_slices, checkpoint_dtype,
                                             copy_tokenizer_files, element_runs,
                                             export_model_to_hf, plan_shards, publish_dir,
                                             tmp_dir, write_index)
from megatron_klear.checkpoint.state import (find_latest_checkpoint, load_checkpoint, read_meta,
                                             save_checkpoint)
from megatron_klear.checkpoint.peft_io import export_peft_adapter, load_peft_adapter
from megatron_klear.config import TrainConfig, parallel_layout
from megatron_klear.distributed import initialize_parallel
from megatron_klear.models import qwen3
from megatron_klear.models.lora import LoraSpec, apply_lora
from megatron_klear.models.context_parallel_layout import slice_for_cp_rank, \
    unslice_from_cp_ranks
from megatron_klear.models.pipeline_layout import PipelineLayout

__all__ = ["ConversionError", "DTYPES", "DTYPE_CHOICES", "convert_hf_to_megatron",
           "convert_megatron_to_hf", "compare_logits", "megatron_logits", "hf_logits",
           "build_model", "init_parallel", "SafetensorsReader", "export_model_to_hf"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


# ---------------------------------------------------------------- shared setup
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init_parallel(tp: int, pp: int, seed: int = 1234, *, vpp: int | None = None, ep: int = 1,
                  etp: int | None = None) -> None:
    """torch.distributed (on a free port when not under torchrun) + megatron parallel state
    with exactly the processes of one model replica: ``tp * pp``, or with expert
    parallelism (carved out of data parallelism) ``pp * lcm(tp, ep * etp)``."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    need = pp * math.lcm(tp, ep * (etp or tp))
    if world != need:
        experts = f" with --expert-model-parallel-size {ep}" if ep > 1 else ""
        raise ConversionError(f"--tp {tp} x --pp {pp}{experts} needs {need} processes, got "
                              f"{world}; launch with torchrun --nproc-per-node {need}")
    initialize_parallel(tp, pp, seed, vpp=vpp, ep=ep, etp=etp)


def _init_conversion() -> None:
    """Conversions work at the TP1/PP1 layout with any number of processes (they split
    the files, not the model)."""
    initialize_parallel(1, 1)


def build_model(arch: qwen3.Qwen3Arch, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """This rank's stage of the Qwen3 GPTModel, uninitialised (weights come from a file)."""
    from megatron.core import parallel_state as ps

    moe = qwen3.moe_config_kwargs(arch, ep=ps.get_expert_model_parallel_world_size(),
                                  etp=ps.get_expert_tensor_parallel_world_size())
    config = qwen3.transformer_config(arch, tp=ps.get_tensor_model_parallel_world_size(),
                                      pp=ps.get_pipeline_model_parallel_world_size(),
                                      params_dtype=dtype, perform_initialization=False, **moe)
    return qwen3.build_gpt_model(arch, config).eval()


def _check_layout(arch: qwen3.Qwen3Arch, layout: TrainConfig) -> PipelineLayout:
    """The pipeline split of the layout flags for this model; :class:`ConversionError`
    naming the flags when they cannot split it (as the trainer would refuse them)."""
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    ep = layout.expert_model_parallel_size
    try:
        pipeline = qwen3.check_parallel_layout(arch, tp, pp,
                                               PipelineLayout.from_config(arch.num_layers, layout))
        if arch.is_moe and arch.num_experts % ep:
            raise qwen3.ConfigError(f"--expert-model-parallel-size {ep} does not divide "
                                    f"num_experts={arch.num_experts}")
    except qwen3.ConfigError as exc:
        raise ConversionError(f"--tp {tp} / --pp {pp}: {exc}; choose sizes that divide the "
                              "model") from exc
    return pipeline


def _layout(layout: TrainConfig | None, tp: int, pp: int) -> TrainConfig:
    """``layout`` (all the trainer's layout flags), else the plain ``tp`` x ``pp`` one."""
    return layout or parallel_layout(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp)


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise ConversionError(f"--out-dir {out_dir} already exists; pass --overwrite to replace "
                              "it or choose another directory")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_CHOICES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {list(DTYPE_CHOICES)}")


def _check_threads(threads: int) -> None:
    if threads < 1:
        raise ConversionError(f"--threads {threads}: must be >= 1")


_F = TypeVar("_F", bound=Callable)


def _frozen_gc(fn: _F) -> _F:
    """Run ``fn`` with the objects that exist at its start (torch's and megatron's import
    graph, ~4x10^5 objects) moved out of the garbage collector's view (``gc.freeze``): the
    collections that a conversion's allocations trigger otherwise rescan them all, which
    cost ~0.3 s of CPU per conversion of Qwen3-0.6B."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.unfreeze()
    return wrapper  # type: ignore[return-value]


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", disable=_rank() != 0)


# ---------------------------------------------------------------- HF -> Megatron
@_frozen_gc
def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1,
                           dtype: str = "auto", overwrite: bool = False,
                           threads: int = 1, layout: TrainConfig | None = None) -> Path:
    """Convert an HF Qwen3 directory into a Megatron ``torch_dist`` checkpoint (iteration 0).

    Checks that ``tp``/``pp`` (or the trainer's whole ``layout``: uneven stages, VPP, EP,
    see :func:`~megatron_klear.config.add_layout_flags`) split the model; the result loads at
    any layout. Collective
    over all ranks (any number: each writes its share, ``threads`` files at a time; one
    thread keeps peak memory at one tensor per process); returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    _check_dtype(dtype)
    _check_threads(threads)
    hf_config = qwen3.load_hf_config(hf_dir)
    arch = qwen3.qwen3_config_from_hf(hf_config)
    _check_layout(arch, _layout(layout, tp, pp))
    _check_out_dir(out_dir, overwrite)
    reader = SafetensorsReader(hf_dir)
    hf_bridge.check_hf_names(reader.names(), arch)
    for name in reader.names():
        hf_bridge.check_hf_shape(name, reader.shape(name), arch)
    params_dtype = checkpoint_dtype(hf_config, reader) if dtype == "auto" else DTYPES[dtype]
    _init_conversion()
    model = torch_dist_io.meta_model(arch, params_dtype)
    slots = torch_dist_io.param_slots(model, arch)
    with _progress(sum(len(s.chunks) for s in slots), "hf->megatron") as bar:
        def build(slot: torch_dist_io.ParamSlot) -> list[torch.Tensor]:
            bar.update(1)
            return hf_bridge.split_parts_for_rank(slot.rule.kind,
                                                  [reader.mapped(n) for n in slot.hf], arch, 1, 0)

        tmp = tmp_dir(out_dir)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(tmp, 0, [torch_dist_io.TECompatible(model)], hf_config=hf_config,
                        trainer="convert",
                        sharded_strategy=torch_dist_io.StreamingSaveStrategy(
                            slots, build, threads, release=reader.release, maps=reader.maps))
    if _rank() == 0:
        publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


# ---------------------------------------------------------------- Megatron -> HF
@_frozen_gc
def convert_megatron_to_hf(load_dir: str | Path, out_dir: str | Path, *,
                           hf_config_dir: str | Path | None = None, overwrite: bool = False,
                           max_shard_bytes: int = 5 * 2**30, dtype: str = "auto",
                           threads: int = 1, layout: TrainConfig | None = None) -> Path:
    """Write sharded safetensors + index + config.json (+ tokenizer files) from a checkpoint.

    Any saved TP/PP layout; collective over all ranks (any number: shard k is written by
    rank k mod N, ``threads`` shards at a time per rank; one thread keeps peak memory at
    one parameter per process). ``hf_config_dir`` supplies config.json and tokenizer
    files; without it the HF config stored in the checkpoint's meta is used. ``layout``
    (the trainer's layout flags) is only checked against the model: the output has none.
    """
    out_dir = Path(out_dir)
    _check_dtype(dtype)
    _check_threads(threads)
    _check_out_dir(out_dir, overwrite)
    path = find_latest_checkpoint(load_dir)
    if path is None:
        raise ConversionError(f"--load {load_dir}: no complete checkpoint found (expected "
                              "iter_XXXXXXX/klear_meta.json)")
    meta = read_meta(path)
    hf_config = (qwen3.load_hf_config(hf_config_dir) if hf_config_dir is not None
                 else meta.get("hf_config"))
    if not hf_config:
        raise ConversionError(f"--load {path}: the checkpoint stores no HF config; pass "
                              "--hf-config DIR with the model's config.json")
    arch = qwen3.qwen3_config_from_hf(hf_config)
    if layout is not None:
        _check_layout(arch, layout)
    out_dtype = getattr(torch, meta["params_dtype"]) if dtype == "auto" else DTYPES[dtype]
    _init_conversion()
    sources = _hf_sources(torch_dist_io.param_slots(torch_dist_io.meta_model(arch, out_dtype),
                                                    arch), arch)
    plans = plan_shards(((n, out_dtype, hf_bridge.hf_shape(n, arch)) for n in sources),
                        max_shard_bytes)
    tmp = tmp_dir(out_dir)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    reader = torch_dist_io.TorchDistReader(path)
    mine = plans[_rank()::dist.get_world_size()]
    with _progress(len(plans), "megatron->hf") as bar, ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(lambda p: _write_hf_shard(tmp, p, sources, reader, arch), mine):
            bar.update(dist.get_world_size())
    dist.barrier()
    if _rank() == 0:
        write_index(tmp, plans)
        if hf_config_dir is not None:
            copy_tokenizer_files(Path(hf_config_dir), tmp)
        name = str(out_dtype).replace("torch.", "")
        config = dict(hf_config, torch_dtype=name, **({"dtype": name} if "dtype" in hf_config
                                                       else {}))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


def _hf_sources(slots: list[torch_dist_io.ParamSlot], arch: qwen3.Qwen3Arch
                ) -> dict[str, torch_dist_io.ParamSlot]:
    """HF tensor name -> the parameter slot it is exported from (HF tying convention), in
    layer-major order (a parameter's HF tensors are adjacent, so they share a shard)."""
    sources: dict[str, torch_dist_io.ParamSlot] = {}
    for slot in slots:
        if slot.rule.megatron[0] == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        for n in slot.hf:
            sources.setdefault(n, slot)
    missing = set(hf_bridge.hf_tensor_names(arch)) - set(sources)
    if missing:
        raise ConversionError(f"no Megatron parameter exports {sorted(missing)[0]!r}")
    return sources


def _write_hf_shard(out: Path, plan: ShardPlan, sources: dict[str, torch_dist_io.ParamSlot],
                    reader: torch_dist_io.TorchDistReader, arch: qwen3.Qwen3Arch) -> None:
    """Fill one planned safetensors shard, one Megatron parameter at a time: in the saved
    dtype, the kernel copies the bytes from the checkpoint's files to the shard (q/k/v as
    blocks of rows per group); another dtype is converted in memory."""
    wanted = {n: d for n, d, _ in plan.tensors}
    slots = list({id(sources[n]): sources[n] for n in wanted}.values())
    shard = ShardWriter(out / plan.file, plan)
    for slot in slots:
        parts = reader.read_parts(slot.key, slot.prefix)
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        meta = torch.empty(shape, dtype=parts[0].dtype, device="meta")
        for n, (view, _) in zip(slot.hf, hf_bridge.merge_views(slot.rule.kind, meta, 1, arch)):
            if n not in wanted:
                continue
            if wanted[n] == parts[0].dtype:
                shard.write_bytes(n, byte_slices(parts, element_runs(view)), reader.maps)
            else:
                full = parts[0] if len(parts) == 1 else torch.cat(parts)
                merged = hf_bridge.merge_shards(slot.rule.kind, [full], arch)
                shard.write(n, merged[slot.hf.index(n)].to(wanted[n]))
        del parts
        reader.release()
    shard.close()


# ---------------------------------------------------------------- parity
@torch.no_grad()
def megatron_logits(model: torch.nn.Module | list[torch.nn.Module], arch: qwen3.Qwen3Arch,
                    input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab fp32 logits [b, s, vocab] on the last pipeline stage (every TP and CP rank
    of it), None on other stages. Runs megatron's forward-only pipeline schedule over the
    model chunk(s) (the interleaved schedule wants at least PP micro-batches: the same
    ids are then fed PP times). ``input_ids`` may be on any device: the model gets them on
    its own (the embedding refuses an index on another device). Under context parallelism
    each CP rank runs its load-balanced slice (padded to 2 x CP) and the slices are gathered."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    cp = ps.get_context_parallel_world_size()
    padded = s + (-s % (2 * cp) if cp > 1 else 0)
    ids = torch.nn.functional.pad(input_ids.to(platform.device()), (0, padded - s))
    positions = torch.arange(padded, device=ids.device).expand(b, padded)
    ids, positions = (slice_for_cp_rank(t, cp, ps.get_context_parallel_rank())
                      for t in (ids, positions))

    def forward_step(data_iterator, chunk):
        out = chunk(next(data_iterator), positions, attention_mask=None)
        return out, lambda t: (t.sum() * 0, {"logits": t})

    chunks = model if isinstance(model, list) else [model]
    n = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    data = [iter([ids] * n) for _ in chunks] if len(chunks) > 1 else iter([ids])
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks,
        num_microbatches=n, seq_length=padded, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(results[0]["logits"])
    if cp > 1:
        slices = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(slices, logits.contiguous(), group=ps.get_context_parallel_group())
        logits = unslice_from_cp_ranks(slices)[:, :s]
    return logits[..., : arch.vocab_size].float()


def compare_logits(hf_dir: str | Path, megatron_dir: str | Path | None, *, tp: int = 1,
                   pp: int = 1, batch_size: int = 2, seq_length: int = 32, seed: int = 0,
                   layout: TrainConfig | None = None, lora: LoraSpec | None = None,
                   peft_dir: str | Path | None = None) -> float:
    """Max |HF logits - Megatron logits| on random token ids (fp32); same value on all ranks.

    Collective over the ranks of one model replica (torchrun); builds the model as the
    trainer does at ``tp`` x ``pp``, or at the trainer's whole ``layout`` (uneven stages,
    VPP, EP), and loads the Megatron checkpoint into it in fp32, whatever layout it was
    saved at. With ``lora`` the model gets adapters: from ``peft_dir`` (a PEFT LoRA folder,
    on the base of ``megatron_dir``'s full checkpoint, else of ``hf_dir``'s weights) or from
    ``megatron_dir``'s adapters-only checkpoint (on ``hf_dir``'s weights); the reference is
    then transformers + ``peft`` with that folder, or with the checkpoint's adapters
    exported as one.
    """
    layout = _layout(layout, tp, pp)
    hf_config = qwen3.load_hf_config(hf_dir)
    arch = qwen3.qwen3_config_from_hf(hf_config)
    pipeline = _check_layout(arch, layout)
    ckpt = find_latest_checkpoint(megatron_dir) if megatron_dir else None
    if megatron_dir and ckpt is None:
        raise ConversionError(f"--megatron-dir {megatron_dir}: no complete checkpoint found")
    adapters_only = ckpt is not None and bool(read_meta(ckpt).get("lora"))
    if (peft_dir or adapters_only) and lora is None:
        raise ConversionError("adapters need the LoRA flags: --lora-load DIR, or --lora-rank "
                              "(and --lora-alpha, --lora-target-modules) as the run trained them")
    if peft_dir and adapters_only:
        raise ConversionError(f"--lora-load {peft_dir} and the adapters-only checkpoint "
                              f"{megatron_dir} both give adapters: drop one")
    if ckpt is None and peft_dir is None:
        raise ConversionError("give --megatron-dir (a checkpoint) or --lora-load (a PEFT folder "
                              "on --hf-dir's weights)")
    init_parallel(layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  vpp=pipeline.virtual_size, ep=layout.expert_model_parallel_size,
                  etp=layout.expert_tensor_parallel_size)
    chunks = [chunk.eval() for chunk in qwen3.build_model_chunks(arch, layout)]
    for chunk in chunks if lora is not None else ():
        apply_lora(chunk, arch, lora)
    if ckpt is None or adapters_only:  # the base from the HF weights
        hf_bridge.load_hf_weights(chunks, arch, SafetensorsReader(str(hf_dir)))
    if ckpt is not None:
        load_checkpoint(megatron_dir, chunks, load_rng=False)
    if peft_dir is not None:
        load_peft_adapter(chunks, lora, peft_dir)
    ids = torch.randint(0, arch.vocab_size, (batch_size, seq_length),
                        generator=torch.Generator().manual_seed(seed))
    logits = megatron_logits(chunks, arch, ids)
    with _reference_adapter(chunks, lora, peft_dir, adapters_only) as adapter:
        diff = torch.zeros((), dtype=torch.float64, device=platform.device())  # NCCL: GPU
        if logits is not None:
            diff.fill_((hf_logits(hf_dir, ids, adapter) - logits.cpu()).abs().max().item())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


@contextlib.contextmanager
def _reference_adapter(chunks, lora: LoraSpec | None, peft_dir: str | Path | None,
                       export: bool) -> Iterator[str | Path | None]:
    """The PEFT folder of the reference: ``peft_dir``, or with ``export`` the model's
    adapters exported into a temp dir (collective; removed afterwards)."""
    if not export:
        yield peft_dir
        return
    held = [tempfile.mkdtemp(prefix="compare_logits_peft_") if _rank() == 0 else None]
    dist.broadcast_object_list(held, src=0)
    try:
        yield export_peft_adapter(chunks, lora, Path(held[0]) / "peft")
    finally:
        if _rank() == 0:
            shutil.rmtree(held[0], ignore_errors=True)


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor,
              peft_dir: str | Path | None = None) -> torch.Tensor:
    """transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM logits (fp32, eager attention),
    with ``peft`` loading the LoRA folder ``peft_dir`` when given: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    if peft_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(peft_dir)).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()
