"""Convert a Hugging Face Qwen3 checkpoint into a Megatron torch_dist checkpoint (iteration 0).

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-8B --out-dir ckpt/qwen3-8b
    torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py --hf-dir ... --out-dir ...

The output loads at any TP/PP layout (the trainer's layout flags, --tp/--pp and the rest, only
check that they split the model); a
trainer started with --load on it begins from these weights. Tensors stream from file to
file (no model in memory); N torchrun processes split the writing N ways.
"""

from __future__ import annotations

import argparse

from _cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The flags of this tool (the layout ones shared with the trainers)."""
    from megatron_klear.checkpoint.convert import DTYPE_CHOICES
    from megatron_klear.config import OneLineParser, add_layout_flags

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model dir (config.json + *.safetensors)")
    p.add_argument("--out-dir", required=True, help="output checkpoint dir (must not exist)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="parameter dtype (auto: config torch_dtype/dtype, else the tensors')")
    p.add_argument("--threads", type=int, default=1,
                   help="files written at once per process (each holds one tensor in memory)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    add_layout_flags(p)
    return p


def main() -> None:
    from megatron_klear.checkpoint.convert import convert_hf_to_megatron
    from megatron_klear.config import layout_from_args

    a = build_parser().parse_args()
    out = convert_hf_to_megatron(a.hf_dir, a.out_dir, layout=layout_from_args(a), dtype=a.dtype,
                                 overwrite=a.overwrite, threads=a.threads)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
