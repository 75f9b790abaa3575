"""Hugging Face <-> Megatron conversion and the logit parity check behind the tools/ CLIs.

* :func:`convert_hf_to_megatron` reads safetensors shards one at a time (memory-mapped,
  closed before the next) into the Megatron model of this rank's TP/PP shard and writes
  iteration 0 of a training checkpoint (model only) with
  :func:`~megatron_klear.checkpoint.state.save_checkpoint`; ``torch_dist`` makes it
  loadable at any TP/PP layout, and ``--load`` of a trainer starts from it.
* :func:`convert_megatron_to_hf` loads a checkpoint at TP1/PP1 (dist_checkpointing
  reshards) and streams :func:`~megatron_klear.checkpoint.hf_bridge.export_hf_weights`
  into size-bounded safetensors shards plus ``model.safetensors.index.json``.
* :func:`compare_logits` runs transformers' Qwen3 (fp32, eager) and the Megatron model
  at a TP/PP layout on the same token ids and returns the max absolute logit difference.

Every output is written to a temp dir next to the target and renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_klear.checkpoint import hf_bridge
from megatron_klear.checkpoint.state import (find_latest_checkpoint, load_checkpoint, read_meta,
                                             save_checkpoint)
from megatron_klear.models import qwen3

__all__ = ["ConversionError", "DTYPES", "convert_hf_to_megatron", "convert_megatron_to_hf",
           "compare_logits", "megatron_logits", "build_model", "init_parallel",
           "SafetensorsReader", "export_model_to_hf"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class ConversionError(ValueError):
    """Bad converter input; the message names the flag, file or tensor and the fix."""


# ---------------------------------------------------------------- shared setup
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init_parallel(tp: int, pp: int, seed: int = 1234) -> None:
    """torch.distributed (on a free port when not under torchrun) + megatron parallel state."""
    import socket

    from megatron_klear.train.engine import initialize_parallel

    if not dist.is_initialized() and "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world != tp * pp:
        raise ConversionError(f"--tp {tp} x --pp {pp} needs {tp * pp} processes, got {world}; "
                              f"launch with torchrun --nproc-per-node {tp * pp}")
    initialize_parallel(tp, pp, seed)


def build_model(arch: qwen3.Qwen3Arch, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """This rank's stage of the Qwen3 GPTModel, uninitialised (weights come from a file)."""
    from megatron.core import parallel_state as ps

    config = qwen3.transformer_config(arch, tp=ps.get_tensor_model_parallel_world_size(),
                                      pp=ps.get_pipeline_model_parallel_world_size(),
                                      params_dtype=dtype, perform_initialization=False)
    return qwen3.build_gpt_model(arch, config).eval()


def _check_layout(arch: qwen3.Qwen3Arch, tp: int, pp: int) -> None:
    try:
        qwen3.check_parallel_layout(arch, tp, pp)
    except qwen3.ConfigError as exc:
        raise ConversionError(f"--tp {tp} / --pp {pp}: {exc}; choose sizes that divide the "
                              "model") from exc


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise ConversionError(f"--out-dir {out_dir} already exists; pass --overwrite to replace "
                              "it or choose another directory")


def _tmp_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.tmp"


def _publish_dir(tmp: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the finished ``tmp`` (rename; the old one goes only after)."""
    old = out_dir.parent / f".{out_dir.name}.old"
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _progress(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", disable=_rank() != 0)


# ---------------------------------------------------------------- HF -> Megatron
class SafetensorsReader:
    """The tensors of an HF model directory (any shard count), read lazily.

    Only headers are read up front. :meth:`shards` opens one shard at a time (memory-mapped)
    and closes it before the next, so reading never maps more than one shard.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        hf_dir = Path(hf_dir)
        self._files = sorted(hf_dir.glob("*.safetensors"))
        if not self._files:
            raise ConversionError(f"--hf-dir {hf_dir}: no *.safetensors files (only safetensors "
                                  "checkpoints are supported; re-save with safe_serialization)")
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in self._files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    self._where[name] = f
                    self._shapes[name] = tuple(h.get_slice(name).get_shape())

    def names(self) -> list[str]:
        """All tensor names across shards."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its shard header."""
        return self._shapes[name]

    def shards(self) -> Iterator[tuple[set[str], Callable[[str], torch.Tensor]]]:
        """(names, getter) per shard; each shard is closed when the next is requested."""
        from safetensors import safe_open

        for f in self._files:
            with safe_open(str(f), framework="pt") as h:
                yield set(h.keys()), h.get_tensor

    def __call__(self, name: str) -> torch.Tensor:
        """One tensor by name (opens its shard for this read only)."""
        from safetensors import safe_open

        if name not in self._where:
            raise KeyError(name)
        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name)


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1,
                           dtype: str = "bf16", overwrite: bool = False) -> Path:
    """Convert an HF Qwen3 directory into a Megatron ``torch_dist`` checkpoint (iteration 0).

    One process converts at TP1/PP1 after checking that ``tp``/``pp`` split the model (the
    result loads at any layout); under torchrun with ``tp * pp`` ranks each rank converts
    only its shard. Collective; returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    hf_config = qwen3.load_hf_config(hf_dir)
    arch = qwen3.qwen3_config_from_hf(hf_config)
    _check_layout(arch, tp, pp)
    _check_out_dir(out_dir, overwrite)
    reader = SafetensorsReader(hf_dir)
    hf_bridge.check_hf_names(reader.names(), arch)
    for name in reader.names():
        hf_bridge.check_hf_shape(name, reader.shape(name), arch)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    run_tp, run_pp = (tp, pp) if world > 1 else (1, 1)
    init_parallel(run_tp, run_pp)
    model = build_model(arch, DTYPES[dtype])
    with _progress(sum(1 for _ in model.parameters()), "hf->megatron") as bar:
        hf_bridge.load_hf_weights_from_shards([model], arch, reader.shards(),
                                              on_param=lambda: bar.update(1))
    tmp = _tmp_dir(out_dir)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(tmp, 0, [model], hf_config=hf_config)
    if _rank() == 0:
        _publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


# ---------------------------------------------------------------- Megatron -> HF
def convert_megatron_to_hf(load_dir: str | Path, out_dir: str | Path, *,
                           hf_config_dir: str | Path | None = None, overwrite: bool = False,
                           max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write sharded safetensors + index + config.json (+ tokenizer files) from a checkpoint.

    Runs in ONE process (dist_checkpointing reshards any saved layout to TP1/PP1).
    ``hf_config_dir`` supplies config.json and tokenizer files; without it the HF config
    stored in the checkpoint's meta is used.
    """
    out_dir = Path(out_dir)
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
    init_parallel(1, 1)
    dtype = getattr(torch, meta["params_dtype"])
    model = build_model(arch, dtype)
    load_checkpoint(path, [model], load_rng=False)
    tmp = _tmp_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if hf_config_dir is not None:
        _copy_tokenizer_files(Path(hf_config_dir), tmp)
    names = hf_bridge.hf_tensor_names(arch)
    with _progress(len(names), "megatron->hf") as bar:
        _write_shards(_ticking(hf_bridge.export_hf_weights([model], arch), bar), tmp,
                      max_shard_bytes)
    config = dict(hf_config, torch_dtype=meta["params_dtype"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _publish_dir(tmp, out_dir)
    return out_dir


def export_model_to_hf(model_chunks: list[torch.nn.Module], arch: qwen3.Qwen3Arch,
                       out_dir: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Write a live model (any TP/PP, called by every rank) as a Hugging Face checkpoint.

    Each pipeline stage writes its own safetensors shard (from its TP rank 0 of DP rank 0);
    rank 0 writes the index, config.json and tokenizer files, then publishes atomically.
    """
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = _tmp_dir(out_dir)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    tensors = {n: t.contiguous() for n, t in hf_bridge.export_hf_weights(model_chunks, arch)}
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    fname = f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    if writer:
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
    listing: list = [None] * dist.get_world_size()
    dist.all_gather_object(listing, (fname, sorted(tensors), sum(
        t.numel() * t.element_size() for t in tensors.values())) if writer else None)
    if _rank() == 0:
        entries = [e for e in listing if e is not None]
        index = {"metadata": {"total_size": sum(e[2] for e in entries)},
                 "weight_map": dict(sorted((n, f) for f, names, _ in entries for n in names))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if tokenizer_dir is not None:
            _copy_tokenizer_files(Path(tokenizer_dir), tmp)
        (tmp / "config.json").write_text(json.dumps(arch.hf_config, indent=2))
        _publish_dir(tmp, out_dir)
    dist.barrier()
    return out_dir


def _ticking(items: Iterator, bar: tqdm) -> Iterator:
    for item in items:
        bar.update(1)
        yield item


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, dst / f.name)


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path,
                  max_shard_bytes: int) -> None:
    """Stream tensors into ``model-0000k-of-0000n.safetensors`` shards of bounded size."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(pending, str(out / f"part-{len(shards):05d}.safetensors"),
                  metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        pending[name] = t
        size += nbytes
        total += nbytes
    if pending or not shards:
        flush()
    weight_map = {}
    for k, names in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f"part-{k:05d}.safetensors", out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------- parity
@torch.no_grad()
def megatron_logits(model: torch.nn.Module, arch: qwen3.Qwen3Arch,
                    input_ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab fp32 logits [b, s, vocab] on the last pipeline stage (every TP rank of
    it), None on other stages. Runs megatron's forward-only pipeline schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = input_ids.shape
    positions = torch.arange(s).expand(b, s)

    def forward_step(data_iterator, chunk):
        out = chunk(next(data_iterator), positions, attention_mask=None)
        return out, lambda t: (t.sum() * 0, {"logits": t})

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([input_ids]), model=[model],
        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(results[0]["logits"])
    return logits[..., : arch.vocab_size].float()


def compare_logits(hf_dir: str | Path, megatron_dir: str | Path, *, tp: int = 1, pp: int = 1,
                   batch_size: int = 2, seq_length: int = 32, seed: int = 0) -> float:
    """Max |HF logits - Megatron logits| on random token ids (fp32); same value on all ranks.

    Collective over ``tp * pp`` ranks (torchrun); loads the Megatron checkpoint in fp32 at
    the given layout, whatever layout it was saved at.
    """
    hf_config = qwen3.load_hf_config(hf_dir)
    arch = qwen3.qwen3_config_from_hf(hf_config)
    _check_layout(arch, tp, pp)
    if find_latest_checkpoint(megatron_dir) is None:
        raise ConversionError(f"--megatron-dir {megatron_dir}: no complete checkpoint found")
    init_parallel(tp, pp)
    model = build_model(arch, torch.float32)
    load_checkpoint(megatron_dir, [model], load_rng=False)
    ids = torch.randint(0, arch.vocab_size, (batch_size, seq_length),
                        generator=torch.Generator().manual_seed(seed))
    logits = megatron_logits(model, arch, ids)
    diff = torch.zeros((), dtype=torch.float64)
    if logits is not None:
        diff.fill_((hf_logits(hf_dir, ids) - logits).abs().max().item())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3ForCausalLM logits (fp32, eager attention): the reference."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids).logits.float()
