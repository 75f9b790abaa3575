"""Benchmark HF <-> Megatron conversion on a Qwen3-0.6B-shaped model (random bf16, ~1.2 GB).

Measured side by side in one run, each step in a fresh process (so peak RSS is per step):

* baseline: a plain safetensors read + write of the same shards (the local disk limit);
* HF -> Megatron (``convert_hf_to_megatron``, bf16, TP1/PP1);
* Megatron -> HF (``convert_megatron_to_hf``), then a bitwise check against the input.

Prints seconds, GB/s of model bytes, the ratio to the baseline, and peak RSS against the
largest input shard. Nothing is downloaded: the weights are made locally.

    python benchmarks/bench_convert.py [--work-dir DIR] [--shard-size-mb 400]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, torch_dtype="bfloat16")


def make_hf_model(out: Path, shard_bytes: int) -> int:
    """Write random bf16 weights of a Qwen3-0.6B-shaped model in shards; return total bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron_klear.checkpoint.hf_bridge import hf_shape, hf_tensor_names
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config

    config = tiny_qwen3_config(**QWEN3_0_6B)
    arch = qwen3_config_from_hf(config)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    shard: dict = {}
    files: list[list[str]] = []
    total = size = 0

    def flush() -> None:
        save_file(shard, str(out / f"part{len(files)}.safetensors"), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    for name in hf_tensor_names(arch):
        t = (torch.randn(hf_shape(name, arch), generator=gen) * 0.02).to(torch.bfloat16)
        if shard and size + t.numel() * 2 > shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    weight_map = {}
    for k, names in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        (out / f"part{k}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total


def plain_copy(src: Path, dst: Path) -> None:
    """The baseline: read every shard's tensors and write them again with safetensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        save_file(load_file(f), str(dst / f.name), metadata={"format": "pt"})


def bitwise_equal(a: Path, b: Path) -> bool:
    """Every tensor of HF dir ``a`` equals the one of the same name in ``b`` (streamed)."""
    from safetensors import safe_open

    def handles(d: Path) -> dict:
        hs = [safe_open(str(f), framework="pt") for f in sorted(d.glob("*.safetensors"))]
        return {n: h for h in hs for n in h.keys()}

    ha, hb = handles(a), handles(b)
    return set(ha) == set(hb) and all(ha[n].get_tensor(n).equal(hb[n].get_tensor(n)) for n in ha)


def child(step: str, src: str, dst: str) -> None:
    """Run one step in this (fresh) process and print its wall time and peak RSS as JSON."""
    from megatron_klear.checkpoint import convert

    start = time.perf_counter()
    if step == "plain":
        plain_copy(Path(src), Path(dst))
    elif step == "hf2mg":
        convert.convert_hf_to_megatron(src, dst, dtype="bf16")
    else:
        convert.convert_megatron_to_hf(src, dst)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": rss}))


def run_step(step: str, src: Path, dst: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", step, str(src), str(dst)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work-dir", default=None, help="scratch dir (default: a temp dir, removed)")
    p.add_argument("--shard-size-mb", type=int, default=400, help="input safetensors shard size")
    p.add_argument("--child", nargs=3, metavar=("STEP", "SRC", "DST"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        total = make_hf_model(work / "hf", a.shard_size_mb * 2**20)
        largest = max(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
        results = {"plain safetensors read+write": run_step("plain", work / "hf", work / "copy"),
                   "hf -> megatron (torch_dist)": run_step("hf2mg", work / "hf", work / "mg"),
                   "megatron -> hf (safetensors)": run_step("mg2hf", work / "mg", work / "back")}
        same = bitwise_equal(work / "hf", work / "back")
        base = results["plain safetensors read+write"]["seconds"]
        print(f"model: Qwen3-0.6B shape, bf16, {total / 1e9:.2f} GB in "
              f"{len(list((work / 'hf').glob('*.safetensors')))} shards, largest "
              f"{largest / 1e9:.2f} GB; round trip bitwise identical: {same}")
        print(f"{'step':32s} {'seconds':>8s} {'GB/s':>6s} {'x plain':>8s} {'peak RSS GB':>12s} "
              f"{'RSS/shard':>9s}")
        for name, r in results.items():
            print(f"{name:32s} {r['seconds']:8.2f} {total / 1e9 / r['seconds']:6.2f} "
                  f"{r['seconds'] / base:8.2f} {r['peak_rss'] / 1e9:12.2f} "
                  f"{r['peak_rss'] / largest:9.2f}")
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
