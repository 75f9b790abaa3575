"""Logit parity between transformers' Qwen3 (fp32, eager) and a Megatron checkpoint.

    torchrun --nproc-per-node 2 tools/compare_logits.py --hf-dir hf --megatron-dir ckpt --tp 2
    torchrun --nproc-per-node 2 tools/compare_logits.py ... --pp 2 \
        --decoder-first-pipeline-num-layers 1

The model runs at the layout given by the trainer's layout flags (uneven stages, VPP, EP).

With adapters, the trainers' LoRA flags: a PEFT folder (--lora-load; r, alpha and targets
from its adapter_config.json unless given), on --megatron-dir's full checkpoint or, without
one, on --hf-dir's weights; or --megatron-dir an adapters-only checkpoint of a LoRA run
(on --hf-dir's weights; --lora-rank etc. as it trained). The reference is then transformers
with `peft` loading the folder (or the checkpoint's adapters exported as one):

    torchrun --nproc-per-node 2 tools/compare_logits.py --hf-dir hf --lora-load adapter --tp 2

Prints the max absolute logit difference; exits 1 when it exceeds --tolerance.
"""

from __future__ import annotations

import argparse

from _cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    """The flags of this tool (the layout ones shared with the trainers)."""
    from megatron_klear.config import LoraFlags, OneLineParser, add_layout_flags, \
        add_section_flags

    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model dir (the reference)")
    p.add_argument("--megatron-dir", help="Megatron checkpoint dir (full, or a LoRA run's "
                                          "adapters); optional with --lora-load")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max allowed |dlogit|")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    add_layout_flags(p)
    add_section_flags(p, LoraFlags, unset=True)
    return p


def main() -> int:
    import torch.distributed as dist

    from megatron_klear.checkpoint.convert import compare_logits
    from megatron_klear.config import LoraFlags, layout_from_args, section_from_args
    from megatron_klear.models.lora import lora_spec

    a = build_parser().parse_args()
    lora = section_from_args(LoraFlags, a)  # the adapter's r, alpha, targets where not given
    diff = compare_logits(a.hf_dir, a.megatron_dir, layout=layout_from_args(a),
                          batch_size=a.batch_size, seq_length=a.seq_length, seed=a.seed,
                          lora=lora_spec(lora), peft_dir=lora.lora_load)
    ok = diff <= a.tolerance
    if dist.get_rank() == 0:
        print(f"max_abs_logit_diff={diff:.3e} tolerance={a.tolerance:.1e} "
              f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
