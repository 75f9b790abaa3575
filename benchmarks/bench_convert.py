"""Benchmark HF <-> Megatron conversion on a Qwen3-0.6B-shaped model (random bf16, ~1.2 GB).

``--model moe``: the same bytes as a Qwen3-MoE (each layer's MLP split into 16 experts of
width 192, top-4, plus a router), so MoE and dense numbers compare per byte: 16x more, 16x
smaller MLP tensors per layer.

Measured side by side in one run, each step in a fresh process (so peak RSS is per step),
the steps interleaved and repeated ``--repeat`` times (the machine is shared: medians):

* baseline: a plain safetensors read + write of the same shards (the local disk limit);
* HF -> Megatron (``convert_hf_to_megatron``, default flags: dtype auto = bf16);
* Megatron -> HF (``convert_megatron_to_hf``), then a bitwise check against the input.

Prints seconds, GB/s of model bytes, the speed as a fraction of the baseline (target
>= 0.70), and peak RSS above the import floor against the largest input shard (target:
at most one shard plus one layer's tensors). Nothing is downloaded: the weights are made
locally.

    python benchmarks/bench_convert.py [--work-dir DIR] [--shard-size-mb 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
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
# Qwen3-MoE with Qwen3-0.6B's bytes: 16 experts x 192 = the dense 3072-wide MLP
MOE_SAME_BYTES = dict(QWEN3_0_6B, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=192, norm_topk_prob=True, mlp_only_layers=[])


def model_config(model: str) -> dict:
    """The HF config.json of ``--model`` (dense Qwen3-0.6B shape, or its MoE twin)."""
    from megatron_klear.models.tiny import tiny_qwen3_config, tiny_qwen3_moe_config

    return tiny_qwen3_moe_config(**MOE_SAME_BYTES) if model == "moe" else \
        tiny_qwen3_config(**QWEN3_0_6B)


def make_hf_model(out: Path, shard_bytes: int, model: str = "dense") -> int:
    """Write random bf16 weights of a ``--model`` model in shards; return total bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron_klear.checkpoint.hf_bridge import hf_shape, hf_tensor_names
    from megatron_klear.models.qwen3 import qwen3_config_from_hf

    config = model_config(model)
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

    for name in sorted(hf_tensor_names(arch), key=_layer_major):
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


def _layer_major(name: str) -> tuple[int, str]:
    """Order tensors the way HF writes shards: embedding, layer 0, layer 1, ..., head."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return int(parts[2]) + 1, name
    return (0 if "embed" in name else 10**9), name


def plain_copy(src: Path, dst: Path) -> None:
    """The baseline: read every shard's tensors and write them again with safetensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        save_file(load_file(f), str(dst / f.name), metadata={"format": "pt"})
        fd = os.open(dst / f.name, os.O_RDONLY)  # durable, like the converters' outputs
        os.fsync(fd)
        os.close(fd)


def bitwise_equal(a: Path, b: Path) -> bool:
    """Every tensor of HF dir ``a`` equals the one of the same name in ``b`` (streamed)."""
    from safetensors import safe_open

    def handles(d: Path) -> dict:
        hs = [safe_open(str(f), framework="pt") for f in sorted(d.glob("*.safetensors"))]
        return {n: h for h in hs for n in h.keys()}

    ha, hb = handles(a), handles(b)
    return set(ha) == set(hb) and all(ha[n].get_tensor(n).equal(hb[n].get_tensor(n)) for n in ha)


def child(step: str, src: str, dst: str, shard_bytes: int) -> None:
    """Run one step in this (fresh) process; print wall/CPU seconds and peak RSS as JSON."""
    from megatron_klear.checkpoint import convert

    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if step == "plain":
        plain_copy(Path(src), Path(dst))
    elif step == "hf2mg":
        convert.convert_hf_to_megatron(src, dst)
    elif step == "mg2hf":
        convert.convert_megatron_to_hf(src, dst, max_shard_bytes=shard_bytes)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss": peak_rss()}))


def peak_rss() -> int:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it is not inherited from
    the parent across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_step(step: str, src: Path, dst: Path, shard_bytes: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", step, str(src), str(dst),
                           str(shard_bytes)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def layer_bytes(config: dict) -> int:
    """Bytes of one transformer layer's HF tensors (the streaming memory allowance)."""
    from megatron_klear.checkpoint.hf_bridge import hf_shape, hf_tensor_names
    from megatron_klear.models.qwen3 import qwen3_config_from_hf

    arch = qwen3_config_from_hf(config)
    total = 0
    for name in hf_tensor_names(arch):
        if name.startswith("model.layers.0."):
            n = 2
            for d in hf_shape(name, arch):
                n *= d
            total += n
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work-dir", default=None, help="scratch dir (default: a temp dir, removed)")
    p.add_argument("--shard-size-mb", type=int, default=400, help="input safetensors shard size")
    p.add_argument("--repeat", type=int, default=3, help="rounds of all steps (medians reported)")
    p.add_argument("--model", choices=("dense", "moe"), default="dense",
                   help="Qwen3-0.6B shape, or a Qwen3-MoE of the same bytes")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child[:3], int(a.child[3]))
        return
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        report(work, a.shard_size_mb * 2**20, a.repeat, a.model)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def report(work: Path, shard: int, repeat: int, model: str = "dense") -> None:
    """Run the steps ``repeat`` times, interleaved, and print the table."""
    total = make_hf_model(work / "hf", shard, model)
    largest = max(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
    layer = layer_bytes(model_config(model))
    floor = run_step("imports", work / "hf", work / "none", shard)["peak_rss"]
    steps = {"plain safetensors read+write": ("plain", "hf", "copy"),
             "hf -> megatron (torch_dist)": ("hf2mg", "hf", "mg"),
             "megatron -> hf (safetensors)": ("mg2hf", "mg", "back")}
    runs: dict[str, list[dict]] = {name: [] for name in steps}
    same = True
    for _ in range(repeat):
        for name, (step, src, dst) in steps.items():
            shutil.rmtree(work / dst, ignore_errors=True)
            runs[name].append(run_step(step, work / src, work / dst, shard))
        same = same and bitwise_equal(work / "hf", work / "back")
    med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
    base = med["plain safetensors read+write"]
    shape = "Qwen3-MoE (16 experts x 192 per layer) of Qwen3-0.6B's bytes" \
        if model == "moe" else "Qwen3-0.6B shape"
    print(f"model: {shape}, bf16, {total / 1e9:.2f} GB in "
          f"{len(list((work / 'hf').glob('*.safetensors')))} shards, largest "
          f"{largest / 1e9:.2f} GB, one layer {layer / 1e6:.1f} MB; import RSS floor "
          f"{floor / 1e9:.2f} GB; {repeat} interleaved rounds; round trip bitwise identical: "
          f"{same}")
    print(f"{'step':30s} {'wall s (median, all)':>28s} {'cpu s':>6s} {'GB/s':>5s} "
          f"{'speed/plain':>11s} {'peak RSS GB':>11s} {'(RSS-floor)/shard':>17s} {'bound':>5s}")
    for name, rs in runs.items():
        rss = max(r["peak_rss"] for r in rs)
        walls = ", ".join(f"{r['seconds']:.2f}" for r in rs)
        ok = rss - floor <= largest + layer
        print(f"{name:30s} {med[name]:6.2f} ({walls:>19s}) "
              f"{statistics.median(r['cpu'] for r in rs):6.2f} {total / 1e9 / med[name]:5.2f} "
              f"{base / med[name]:11.2f} {rss / 1e9:11.2f} {(rss - floor) / largest:17.2f} "
              f"{'met' if ok else 'NOT':>5s}")


if __name__ == "__main__":
    main()
