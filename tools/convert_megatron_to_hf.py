"""Convert a Megatron checkpoint (any TP/PP layout) into a Hugging Face Qwen3 directory.

    python tools/convert_megatron_to_hf.py --load ckpt/run1 --out-dir hf_out --hf-config Qwen3-8B
    torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py --load ... --out-dir ...

Writes sharded safetensors + model.safetensors.index.json + config.json (+ the tokenizer
files of --hf-config), vocab padding stripped, tied embeddings as in the HF config.
Shards are planned up front and filled one parameter at a time; N torchrun processes
write different shards. The trainer's layout flags are accepted (a launch script can pass
its layout to every tool) and only checked against the model: the output has no layout.
"""

from __future__ import annotations

import argparse

from _cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The flags of this tool (the layout ones shared with the trainers)."""
    from megatron_klear.checkpoint.convert import DTYPE_CHOICES
    from megatron_klear.config import OneLineParser, add_layout_flags

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint dir (its latest complete iteration)")
    p.add_argument("--out-dir", required=True, help="output HF dir (must not exist)")
    p.add_argument("--hf-config", default=None,
                   help="HF dir giving config.json and tokenizer files (default: the config "
                        "stored in the checkpoint, no tokenizer)")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="output dtype (auto: the checkpoint's params_dtype)")
    p.add_argument("--threads", type=int, default=1,
                   help="shards written at once per process (each holds one parameter)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out-dir")
    add_layout_flags(p)
    return p


def main() -> None:
    from megatron_klear.checkpoint.convert import convert_megatron_to_hf
    from megatron_klear.config import layout_from_args

    a = build_parser().parse_args()
    out = convert_megatron_to_hf(a.load, a.out_dir, hf_config_dir=a.hf_config,
                                 overwrite=a.overwrite, layout=layout_from_args(a),
                                 max_shard_bytes=int(a.max_shard_size_gb * 2**30),
                                 dtype=a.dtype, threads=a.threads)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
