"""SFT packing: bin fill on real GSM8K answer lengths, tokens/s packed vs unpacked, and the
cost of building a 32K-token pack.

  python benchmarks/bench_sft.py [--gsm8k ../shared/data/math/gsm8k_test.jsonl] [--steps 20]

Both modes train the same tiny Qwen3 (megatron-core, 1 CPU rank) on the same samples for
the same number of optimizer steps, side by side in one run; "tokens/s" counts real
tokens. Every micro-batch is one THD pack (no padding rows, no mask): unpacked puts one
sample per bin, packed fills bins of --seq-length first-fit decreasing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gsm8k_samples(path: Path, tokenizer, limit: int):
    """(input_ids, loss_mask) of GSM8K question/answer chats, in file order."""
    from megatron_klear.data.sft import tokenize_conversation

    out = []
    for line in path.read_text().splitlines()[:limit]:
        rec = json.loads(line)
        msgs = [{"role": "user", "content": rec["question"]},
                {"role": "assistant", "content": rec["answer"]}]
        out.append(tokenize_conversation(tokenizer, msgs))
    return out


def train_tokens_per_s(samples, seq_length: int, packed: bool, steps: int, bins_per_step: int):

    from megatron_klear.config import TrainConfig
    from megatron_klear.data.packing import build_packed_batch, pack_bins
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.sft import sft_loss_fn

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=103, max_position_embeddings=4096))
    cfg = TrainConfig(seq_length=seq_length, micro_batch_size=bins_per_step,
                      global_batch_size=bins_per_step, lr=1e-3, seed=0)
    engine = build_engine(cfg, arch)
    lengths = [len(ids) for ids, _ in samples]
    bins = pack_bins(lengths, seq_length, window=256 if packed else 1)
    real = 0
    t0 = time.perf_counter()
    for step in range(steps):
        chunk = bins[(step * bins_per_step) % len(bins):][:bins_per_step]
        mb = build_packed_batch(samples, [i for b in chunk for i in b])
        total = float(mb["loss_mask"].sum())
        engine.train_step([mb], sft_loss_fn(arch.vocab_size, total))
        real += sum(lengths[i] - 1 for b in chunk for i in b)
    return real / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gsm8k", default=str(ROOT.parent / "shared/data/math/gsm8k_test.jsonl"))
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bins-per-step", type=int, default=4)
    args = p.parse_args()
    os.environ.setdefault("MASTER_PORT", "29631")
    from megatron_klear.data.packing import padding_fraction
    from megatron_klear.models.tiny import build_tokenizer
    from megatron_klear.distributed import initialize_parallel

    tok = build_tokenizer()
    samples = gsm8k_samples(Path(args.gsm8k), tok, limit=100000)
    samples = [s for s in samples if len(s[0]) <= args.seq_length + 1]
    lengths = [len(ids) for ids, _ in samples]
    pad_packed = padding_fraction(lengths, args.seq_length, packed=True)
    pad_plain = padding_fraction(lengths, args.seq_length, packed=False)
    print(f"GSM8K test answers: {len(lengths)} chats, mean {sum(lengths) / len(lengths):.0f} "
          f"tokens (char tokenizer), bin {args.seq_length}")
    print(f"padding fraction: unpacked {pad_plain:.3f}  packed {pad_packed:.3f}  "
          f"(padding reduced {pad_plain / max(pad_packed, 1e-9):.1f}x)")
    initialize_parallel(1, 1, seed=0)
    rates = {mode: train_tokens_per_s(samples, args.seq_length, mode == "packed", args.steps,
                                      args.bins_per_step) for mode in ("unpacked", "packed")}
    print(f"SFT real tokens/s: unpacked {rates['unpacked']:.0f}  packed {rates['packed']:.0f}  "
          f"ratio {rates['packed'] / rates['unpacked']:.2f}x")
    build_32k(samples)


def build_32k(samples) -> None:
    """Time and size of one 32,768-token pack (the dense-mask packer built a 1 GiB mask)."""
    import torch

    from megatron_klear.data.packing import build_packed_batch, pack_bins

    lengths = [len(ids) for ids, _ in samples]
    members = pack_bins(lengths, 32768, window=None)[0]
    t0 = time.perf_counter()
    pack = build_packed_batch(samples, members)
    dt = time.perf_counter() - t0
    size = sum(v.numel() * v.element_size() for v in pack.values() if torch.is_tensor(v))
    print(f"one 32K bin: {len(members)} samples, {pack['tokens'].numel()} tokens, built in "
          f"{dt * 1e3:.1f} ms, {size / 2**20:.2f} MiB of tensors (no s x s mask)")


if __name__ == "__main__":
    main()
