"""Benchmark: weight sync of a Qwen3-0.6B-shaped model to one embedded rollout server.

The model is built as the trainer builds it (train/engine.build_model: megatron DDP, bf16),
once with the distributed optimizer (the layout of every GPU recipe in examples/: all
parameters in one buffer, so a layer's tensors but its q/k/v lie back to back and a run of
them is sent from parameter memory) and once without it (a storage per parameter).
Measured side by side in one run, in (sync, raw) pairs taken back to back:
  * WeightSync.sync (export from Megatron -> buckets -> HTTP request + gloo broadcast ->
    server loads the tensors), GB/s over the bytes sent: both load formats with the
    distributed optimizer, the default format without it;
  * the transport limit: raw gloo broadcasts of the same bucket sizes (the sync's own bucket
    plan: same bytes, same number of broadcasts) between the trainer and a receiver process
    (same group construction, same loopback TCP).
Prints the ratios (target >= 0.90 for the default format with the distributed optimizer).
``--model moe``: a Qwen3-MoE of the same bytes (bench_convert.MOE_SAME_BYTES: 16 experts x
192 per layer); ``--width``: the layers of a wider Qwen3 (longer runs per layer);
``--skip-pack``: a diagnostic that leaves the pack's copies out of the timed syncs (what a
free pack would give). ``--handles`` (colocated mode, issue 31): instead, the
tensor-handle sync (TensorWeightSync: every bucket packed into shared memory, the server
maps it and copies it in) against the broadcast sync (WeightSync, flattened buckets), same
model, bytes and server, in (broadcast, handles) pairs. Usage:
  python benchmarks/bench_weight_sync.py [--bucket-mb 512] [--repeats 3] [--num-layers 28]
                                         [--model dense|moe] [--width 0.6b|1.7b|4b]
                                         [--min-direct-mb MIB] [--skip-pack] [--handles]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                  torch_dtype="bfloat16")


# Qwen3 layer widths (their config.json): hidden, intermediate, attention heads, KV heads
WIDTHS = {"0.6b": {}, "1.7b": dict(hidden_size=2048, intermediate_size=6144,
                                   num_attention_heads=16, num_key_value_heads=8),
          "4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                     num_key_value_heads=8)}
FORMATS = {"flattened_bucket": "flattened_bucket", "per-tensor": None}
# the first sync plans the buckets; the embedded server pools two receive buffers per bucket
# (the live parameters' and the next sync's), so the second sync still faults fresh pages in
# (measured: the first sync after one warm-up ran at 0.4 of the raw broadcast, later ones at
# 0.7-1.1). Steady state, as in a run of many syncs, starts with the third.
WARMUP_SYNCS = 2


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs / broadcasts")
    p.add_argument("--num-layers", type=int, default=QWEN3_0_6B["num_hidden_layers"],
                   help="override the layer count (smaller = quicker run)")
    p.add_argument("--model", choices=("dense", "moe"), default="dense",
                   help="Qwen3-0.6B shape, or a Qwen3-MoE of the same bytes")
    p.add_argument("--width", choices=tuple(WIDTHS), default="0.6b",
                   help="dense: the layer width of this Qwen3 (the bytes of one layer's run of "
                        "adjacent tensors; use fewer --num-layers for the wider ones)")
    p.add_argument("--min-direct-mb", type=float, default=None,
                   help="WeightSync min_direct_bytes in MiB (default: MIN_DIRECT_BYTES); runs "
                        "of adjacent tensors at least this big are sent with no pack")
    p.add_argument("--skip-pack", action="store_true",
                   help="diagnostic: after the warm-up syncs, packed buckets are sent from "
                        "their buffers without copying the views in (the servers receive the "
                        "warm-up's bytes): bounds what any cheaper pack could gain")
    p.add_argument("--handles", action="store_true",
                   help="colocated mode: the tensor-handle sync against the broadcast sync")
    return p.parse_args()


def _write_model_dir(out: Path, num_layers: int, model: str = "dense", width: str = "0.6b"
                     ) -> Path:
    from bench_convert import model_config  # the same dense / MoE shapes

    from megatron_klear.models.tiny import build_tokenizer

    build_tokenizer(out)
    cfg = dict(model_config(model), num_hidden_layers=num_layers, **WIDTHS[width])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _raw_receiver(port: int, sizes: list[int], count: int) -> None:
    from megatron_klear.rollout.transport.update_group import open_update_group

    group = open_update_group("127.0.0.1", port, 1, 2, "raw", "gloo", 600)
    buf = torch.empty(max(sizes), dtype=torch.uint8)
    for _ in range(count):
        for n in sizes:
            group.broadcast(buf[:n])
    group.close()


class RawBroadcast:
    """The transport limit: gloo broadcasts of the sync's bucket sizes (same bytes, same
    number of broadcasts, back to back from one reused buffer) to a receiver process."""

    def __init__(self, sizes: list[int], count: int) -> None:
        from megatron_klear.distributed import free_port
        from megatron_klear.rollout.transport.update_group import open_update_group

        port = free_port()
        self.sizes = sizes
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver,
                                                    args=(port, sizes, count + 1))
        self.proc.start()
        self.group = open_update_group("127.0.0.1", port, 0, 2, "raw", "gloo", 600)
        self.buf = torch.ones(max(sizes), dtype=torch.uint8)
        self.gbps()  # warm-up: both ends' pages are touched

    def gbps(self) -> tuple[float, float]:
        """One timed round of broadcasts: (GB/s, this process's CPU seconds)."""
        start, cpu = time.perf_counter(), time.process_time()
        for n in self.sizes:
            self.group.broadcast(self.buf[:n])
        seconds = time.perf_counter() - start
        return sum(self.sizes) / seconds / 1e9, time.process_time() - cpu

    def close(self) -> None:  # noqa: D102
        self.group.close()
        self.proc.join()


def _hf_bytes(model_dir: Path) -> int:
    """Bytes of the model's HF tensors in bf16, from config.json alone (a sync sends within
    0.01% of it: megatron keeps the RMSNorm weights in fp32)."""
    from megatron_klear.checkpoint.hf_bridge import hf_shape, hf_tensor_names
    from megatron_klear.models import qwen3

    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(model_dir))
    return sum(torch.Size(hf_shape(n, arch)).numel() * 2 for n in hf_tensor_names(arch))


def _timed_sync(sync, version: str) -> tuple[float, float]:
    """One sync: (GB/s, this process's CPU seconds)."""
    cpu = time.process_time()
    gbps = sync.sync(version)["weight_sync/gbps"]
    return gbps, time.process_time() - cpu


# (layout, load format) measured: the recipes' layout (every GPU recipe in examples/ passes
# --use-distributed-optimizer) in both formats, and the default format without it
LAYOUTS = {"distributed optimizer": True, "separate storage": False}
CASES = [("distributed optimizer", "flattened_bucket"), ("distributed optimizer", "per-tensor"),
         ("separate storage", "flattened_bucket")]


def _skip_pack(sync) -> None:
    """--skip-pack: each packed bucket is copied once more (the warm-up syncs filled both
    buffer slots) and from then on sent as its buffer holds it, so the timed syncs pay
    everything but the pack's copies."""
    pack = sync._pack

    def unpacked(bucket, views, slot):  # same signature as WeightSync._pack
        if not bucket.flattened:
            return pack(bucket, views, slot)
        return [sync._buffers[slot][:bucket.nbytes]]
    sync._pack = unpacked


def _build(model_dir: Path, distributed_optimizer: bool):
    """The model as the trainer builds it (train/engine.build_model: megatron DDP, bf16).
    With the distributed optimizer DDP keeps every parameter in one ``param_data`` buffer;
    without it each parameter has its own storage."""
    from megatron_klear.config import TrainConfig
    from megatron_klear.models import qwen3
    from megatron_klear.train.engine import build_model

    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(model_dir))
    cfg = TrainConfig(bf16=True, use_distributed_optimizer=distributed_optimizer)
    return build_model(arch, cfg), arch


def run(model_dir: Path, args: argparse.Namespace) -> dict[tuple[str, str], dict]:
    """Per (layout, load format): ``pairs``, ((sync GB/s, CPU s), (raw GB/s, CPU s)) measured
    back to back (after :data:`WARMUP_SYNCS` warm-up syncs), so load from other jobs hits both
    sides of each ratio alike, and the sync's ``buckets`` (bytes; ``direct``: sent from the
    parameters' memory). The raw side broadcasts exactly the sync's bucket sizes (its plan)."""
    from megatron_klear.distributed import free_port
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers
    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.distributed import initialize_parallel

    os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(tp=1, pp=1)
    runs: dict[tuple[str, str], dict] = {}
    direct = {} if args.min_direct_mb is None else \
        {"min_direct_bytes": int(args.min_direct_mb * 2**20)}
    with launch_embedded_servers(model_dir, 1, dtype="bfloat16", load_format="dummy",
                                 startup_timeout_s=600) as servers:
        for layout, distributed_optimizer in LAYOUTS.items():
            model, arch = _build(model_dir, distributed_optimizer)
            for fmt in (f for lay, f in CASES if lay == layout):
                sync = WeightSync(servers.urls, model, arch,
                                  bucket_bytes=args.bucket_mb * 2**20,
                                  load_format=FORMATS[fmt], **direct)
                sync.connect()
                for i in range(WARMUP_SYNCS):
                    sync.sync(f"warmup{i}")
                if args.skip_pack:
                    _skip_pack(sync)
                raw = RawBroadcast(sync.bucket_sizes, args.repeats)
                pairs = [(_timed_sync(sync, f"v{i}"), raw.gbps()) for i in range(args.repeats)]
                runs[layout, fmt] = {"pairs": pairs, "buckets": sync.bucket_sizes,
                                     "direct": sync.direct_bytes}
                sync.close()
                raw.close()
            del model
    return runs


def run_handles(model_dir: Path, args: argparse.Namespace) -> list[tuple[float, float]]:
    """--handles: (broadcast GB/s, handles GB/s) pairs, back to back, after the warm-up
    syncs of each; the recipes' layout (distributed optimizer), the default bucket plan."""
    from megatron_klear.distributed import free_port
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers
    from megatron_klear.rollout.transport.tensor_sync import TensorWeightSync
    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.distributed import initialize_parallel

    os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(tp=1, pp=1)
    with launch_embedded_servers(model_dir, 1, dtype="bfloat16", load_format="dummy",
                                 startup_timeout_s=600) as servers:
        model, arch = _build(model_dir, True)
        syncs = [WeightSync(servers.urls, model, arch, bucket_bytes=args.bucket_mb * 2**20),
                 TensorWeightSync(servers.urls, model, arch, bucket_bytes=args.bucket_mb * 2**20)]
        for sync in syncs:
            sync.connect()
            for i in range(WARMUP_SYNCS):
                sync.sync(f"warmup{i}")
        pairs = [tuple(_timed_sync(sync, f"v{i}")[0] for sync in syncs)
                 for i in range(args.repeats)]
        for sync in syncs:
            sync.close()
    return pairs


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _write_model_dir(Path(tmp), args.num_layers, args.model, args.width)
        nbytes = _hf_bytes(model_dir)
        if args.handles:
            pairs = run_handles(model_dir, args)
            ratios = sorted(h / b for b, h in pairs)
            print(f"model: Qwen3-{args.width.upper()} layer width, {args.num_layers} layers, bf16,"
                  f" {nbytes / 1e9:.3f} GB; bucket {args.bucket_mb} MiB; {args.repeats} "
                  f"(broadcast, handles) pairs after {WARMUP_SYNCS} warm-up syncs; load average "
                  f"{os.getloadavg()[0]:.1f}\nbroadcast (WeightSync, flattened): best "
                  f"{max(b for b, _ in pairs):.3f} GB/s, median "
                  f"{sorted(b for b, _ in pairs)[len(pairs) // 2]:.3f}; handles "
                  f"(TensorWeightSync): best {max(h for _, h in pairs):.3f} GB/s, median "
                  f"{sorted(h for _, h in pairs)[len(pairs) // 2]:.3f}; handles / broadcast "
                  f"per pair: median {ratios[len(ratios) // 2]:.2f}, range "
                  f"{ratios[0]:.2f}-{ratios[-1]:.2f}")
            return
        runs = run(model_dir, args)
    shape = "Qwen3-MoE (16 experts x 192 per layer) of Qwen3-0.6B's bytes" \
        if args.model == "moe" else f"Qwen3-{args.width.upper()} layer width"
    print(f"model: {shape}, {args.num_layers} layers, bf16, {nbytes / 1e9:.3f} GB; "
          f"bucket {args.bucket_mb} MiB; min direct run {args.min_direct_mb or 'default'} MiB; "
          f"{args.repeats} (sync, raw) pairs after {WARMUP_SYNCS} "
          f"warm-up syncs; {'PACK SKIPPED (diagnostic); ' if args.skip_pack else ''}"
          f"load average {os.getloadavg()[0]:.1f}")
    for layout, fmt in CASES:
        case = runs[layout, fmt]
        pairs = case["pairs"]
        ratios = sorted(s / r for (s, _), (r, _) in pairs)
        best_sync, best_raw = max(s for (s, _), _ in pairs), max(r for _, (r, _) in pairs)
        worst_raw = min(r for _, (r, _) in pairs)  # the transport's own spread in this run
        cpu_sync = sorted(c for (_, c), _ in pairs)[len(pairs) // 2]
        cpu_raw = sorted(c for _, (_, c) in pairs)[len(pairs) // 2]
        target = " (target >= 0.90)" if (layout, fmt) == CASES[0] else ""
        print(f"{layout}, {fmt}: {len(case['buckets'])} buckets, "
              f"{sum(case['buckets']) / 2**20:.0f} MiB of which {case['direct'] / 2**20:.0f} "
              f"MiB sent from parameter memory (no pack); sync {best_sync:.3f} GB/s, raw gloo "
              f"broadcast {best_raw:.3f} GB/s (best of each; raw's worst pair "
              f"{worst_raw:.3f}); ratio per pair: median "
              f"{ratios[len(ratios) // 2]:.2f}{target}, best {ratios[-1]:.2f}; best/best "
              f"{best_sync / best_raw:.2f}; trainer CPU s (median) sync {cpu_sync:.3f}, raw "
              f"{cpu_raw:.3f}")


if __name__ == "__main__":
    main()
