"""Convert a Hugging Face Qwen3 checkpoint into a Megatron torch_dist checkpoint (iteration 0).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-8B --out-dir ckpt/qwen3-8b --dtype bf16
    torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py --hf-dir ... --tp 2 --pp 2

The output loads at any TP/PP layout; a trainer started with --load on it begins from these
weights.
"""

from __future__ import annotations

import argparse

from _cli import run_cli


def main() -> None:
    from megatron_klear.checkpoint.convert import DTYPES, convert_hf_to_megatron

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model dir (config.json + *.safetensors)")
    p.add_argument("--out-dir", required=True, help="output checkpoint dir (must not exist)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check/convert at")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check/convert at")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    a = p.parse_args()
    out = convert_hf_to_megatron(a.hf_dir, a.out_dir, tp=a.tp, pp=a.pp, dtype=a.dtype,
                                 overwrite=a.overwrite)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
