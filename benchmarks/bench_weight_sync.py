"""Benchmark: weight sync of a Qwen3-0.6B-shaped model to one embedded rollout server.

Measured side by side in one run, in (sync, raw) pairs taken back to back:
  * WeightSync.sync (export from Megatron -> buckets -> HTTP request + gloo broadcast ->
    server loads the tensors), GB/s over the bytes sent, for both load formats;
  * the transport limit: a raw gloo broadcast of ONE flat buffer of the same size between the
    trainer and a receiver process (same group construction, same loopback TCP).
Prints the ratios (target >= 0.90 for the default format). ``--model moe``: a Qwen3-MoE of
the same bytes (bench_convert.MOE_SAME_BYTES: 16 experts x 192 per layer). Usage:
  python benchmarks/bench_weight_sync.py [--bucket-mb 512] [--repeats 3] [--num-layers 28]
                                         [--model dense|moe]
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


FORMATS = {"flattened_bucket": "flattened_bucket", "per-tensor": None}


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs / broadcasts")
    p.add_argument("--num-layers", type=int, default=QWEN3_0_6B["num_hidden_layers"],
                   help="override the layer count (smaller = quicker run)")
    p.add_argument("--model", choices=("dense", "moe"), default="dense",
                   help="Qwen3-0.6B shape, or a Qwen3-MoE of the same bytes")
    return p.parse_args()


def _write_model_dir(out: Path, num_layers: int, model: str = "dense") -> Path:
    from bench_convert import model_config  # the same dense / MoE shapes

    from megatron_klear.models.tiny import build_tokenizer

    build_tokenizer(out)
    cfg = dict(model_config(model), num_hidden_layers=num_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _raw_receiver(port: int, nbytes: int, count: int) -> None:
    from megatron_klear.rollout.update_group import open_update_group

    group = open_update_group("127.0.0.1", port, 1, 2, "raw", "gloo", 600)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(count):
        group.broadcast(buf)
    group.close()


class RawBroadcast:
    """The transport limit: gloo broadcast of one flat buffer to a receiver process."""

    def __init__(self, nbytes: int, count: int) -> None:
        from megatron_klear.rollout.launcher import free_port
        from megatron_klear.rollout.update_group import open_update_group

        port = free_port()
        self.proc = mp.get_context("spawn").Process(target=_raw_receiver,
                                                    args=(port, nbytes, count + 1))
        self.proc.start()
        self.group = open_update_group("127.0.0.1", port, 0, 2, "raw", "gloo", 600)
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.group.broadcast(self.buf)  # warm-up: both ends' pages are touched

    def gbps(self) -> float:
        """One timed broadcast, in GB/s."""
        start = time.perf_counter()
        self.group.broadcast(self.buf)
        return self.buf.numel() / (time.perf_counter() - start) / 1e9

    def close(self) -> None:  # noqa: D102
        self.group.close()
        self.proc.join()


def _hf_bytes(model_dir: Path) -> int:
    """Bytes of the model's HF tensors in bf16, from config.json alone (the raw buffer size;
    a sync sends within 0.01% of it: megatron keeps the RMSNorm weights in fp32)."""
    from megatron_klear.checkpoint.hf_bridge import hf_shape, hf_tensor_names
    from megatron_klear.models import qwen3

    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(model_dir))
    return sum(torch.Size(hf_shape(n, arch)).numel() * 2 for n in hf_tensor_names(arch))


def export_seconds(model, arch) -> float:
    """Seconds to iterate export_hf_weights once (the Megatron -> HF copy, no transfer)."""
    from megatron_klear.checkpoint.hf_bridge import export_hf_weights

    start = time.perf_counter()
    for _ in export_hf_weights([model], arch):
        pass
    return time.perf_counter() - start


def run(model_dir: Path, args: argparse.Namespace) -> dict[str, list]:
    """Per load format: (sync GB/s, raw GB/s) pairs measured back to back (after a warm-up
    sync), so load from other jobs on the machine hits both sides of each ratio alike."""
    from megatron_klear.models import qwen3
    from megatron_klear.rollout.launcher import free_port, launch_embedded_servers
    from megatron_klear.rollout.weight_sync import WeightSync
    from megatron_klear.train.engine import initialize_parallel

    os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(tp=1, pp=1)
    arch = qwen3.qwen3_config_from_hf(qwen3.load_hf_config(model_dir))
    config = qwen3.transformer_config(arch, params_dtype=torch.bfloat16,
                                      perform_initialization=False)
    model = qwen3.build_gpt_model(arch, config)
    runs: dict[str, list] = {"export only": [export_seconds(model, arch)
                                             for _ in range(args.repeats)]}
    raw = RawBroadcast(_hf_bytes(model_dir), len(FORMATS) * args.repeats)
    with launch_embedded_servers(model_dir, 1, dtype="bfloat16", load_format="dummy",
                                 startup_timeout_s=600) as servers:
        for fmt, load_format in FORMATS.items():
            sync = WeightSync(servers.urls, [model], arch, bucket_bytes=args.bucket_mb * 2**20,
                              load_format=load_format)
            sync.connect()
            sync.sync("warmup")
            runs[fmt] = [(sync.sync(f"v{i}")["weight_sync/gbps"], raw.gbps())
                         for i in range(args.repeats)]
            sync.close()
    raw.close()
    return runs


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _write_model_dir(Path(tmp), args.num_layers, args.model)
        nbytes = _hf_bytes(model_dir)
        runs = run(model_dir, args)
    shape = "Qwen3-MoE (16 experts x 192 per layer) of Qwen3-0.6B's bytes" \
        if args.model == "moe" else "Qwen3-0.6B shape"
    print(f"model: {shape}, {args.num_layers} layers, bf16, {nbytes / 1e9:.3f} GB; "
          f"bucket {args.bucket_mb} MiB; {args.repeats} (sync, raw) pairs after a warm-up")
    print(f"export_hf_weights alone (no transfer): {min(runs.pop('export only')):.3f} s (best)")
    for fmt, pairs in runs.items():
        ratios = sorted(s / r for s, r in pairs)
        best_sync, best_raw = max(s for s, _ in pairs), max(r for _, r in pairs)
        print(f"{fmt:>16}: sync {best_sync:.3f} GB/s, raw gloo broadcast {best_raw:.3f} GB/s "
              f"(best of each); ratio per pair: median {ratios[len(ratios) // 2]:.2f}, "
              f"best {ratios[-1]:.2f}; best/best {best_sync / best_raw:.2f} (target >= 0.90)")


if __name__ == "__main__":
    main()
