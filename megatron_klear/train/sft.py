"""Long-CoT SFT trainer (``klear-sft``): response-only loss, packing, any TP/PP, exact resume.

Samples are packed into bins (first-fit decreasing); a micro-batch is one THD pack of whole
samples (no padding, no attention across samples, see :mod:`megatron_klear.data.packing`).
Every rank reads the whole dataset and derives the same epoch order from the seed, so the
data position of a run is one number (bins consumed), saved with each checkpoint.
"""

from __future__ import annotations

import random
import sys
from typing import Iterator, Sequence

import torch

from megatron_klear.data.microbatches import sft_microbatches
from megatron_klear.data.packing import pack_bins
from megatron_klear.data.prompts import parse_chat_template_kwargs, set_chat_template_kwargs
from megatron_klear.data.sft import SFTSample, load_sft_dataset
from megatron_klear.ops.backend import loss_backend
from megatron_klear.train.loop import finish, model_arch, open_log, run_steps, start_run
from megatron_klear.train.memory import Workload
from megatron_klear.train.sft_config import SFTConfig
from megatron_klear.train.sft_objective import token_nll


class BinSchedule:
    """The deterministic stream of packed bins: epoch e is a seeded shuffle, packing, and a
    seeded shuffle of the bins."""

    def __init__(self, samples: Sequence[SFTSample], bin_size: int, seed: int, pack: bool):
        self.samples, self.bin_size, self.seed, self.pack = samples, bin_size, seed, pack
        self._epoch_bins: dict[int, list[list[int]]] = {}

    def epoch(self, e: int) -> list[list[int]]:
        """Bins of epoch ``e`` as lists of sample indices."""
        if e not in self._epoch_bins:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1000003 + e).shuffle(order)
            lengths = [len(self.samples[i].input_ids) for i in order]
            bins = [[order[j] for j in b] for b in
                    pack_bins(lengths, self.bin_size, window=256 if self.pack else 1)]
            # packing emits bins by length inside a window: shuffle so steps stay i.i.d.
            random.Random(self.seed * 1000003 + e + 1).shuffle(bins)
            self._epoch_bins = {e: bins}  # keep one epoch in memory
        return self._epoch_bins[e]

    def take(self, consumed: int, count: int) -> Iterator[tuple[int, list[int]]]:
        """``count`` bins starting at global position ``consumed``: (epoch, bin) pairs."""
        e, pos = 0, consumed
        while pos >= len(self.epoch(e)):
            pos -= len(self.epoch(e))
            e += 1
        for _ in range(count):
            bins = self.epoch(e)
            yield e, bins[pos]
            pos += 1
            if pos == len(bins):
                e, pos = e + 1, 0


def sft_loss_fn(vocab_size: int, normalizer: float, backend: str = "auto"):
    """Token-level NLL over response tokens, normalised by the global batch's token count
    (``backend``: the resolved ``--loss-backend``)."""

    def loss_fn(logits: torch.Tensor, batch: dict):
        nll = token_nll(logits, batch["labels"], vocab_size, backend) * batch["loss_mask"]
        loss = nll.sum() / max(normalizer, 1.0)
        return loss, {"loss": loss.detach(), "tokens": batch["loss_mask"].sum()}

    return loss_fn


def train(cfg: SFTConfig) -> list[dict]:
    """Run SFT; returns the per-step metrics of this run (rank 0 writes them to disk too)."""
    from transformers import AutoTokenizer

    arch = model_arch(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
    set_chat_template_kwargs(tokenizer, parse_chat_template_kwargs(cfg.chat_template_kwargs))
    samples, stats = load_sft_dataset(
        cfg.data_path, tokenizer, max_length=cfg.seq_length + 1, prompt_key=cfg.prompt_key,
        response_key=cfg.response_key, messages_key=cfg.messages_key, overflow=cfg.overflow,
        multi_turn=cfg.sft_multi_turn)
    run = start_run(cfg, arch, "consumed_bins")
    backend = loss_backend(cfg.loss_backend)
    consumed = run.position
    schedule = BinSchedule(samples, cfg.bin_size, cfg.seed, cfg.pack)
    log = open_log(cfg, "sft", run.step)
    if run.step == 0 and log.enabled:
        print(f"[sft] {stats.loaded} samples ({stats.truncated} truncated, {stats.dropped} "
              f"dropped, longer than --seq-length {cfg.seq_length})", file=sys.stderr)

    def take_step(step: int) -> dict:
        """One optimizer step on the next ``--global-batch-size`` bins."""
        nonlocal consumed
        taken = list(schedule.take(consumed, cfg.global_batch_size))
        mbs, total = sft_microbatches(samples, [b for _, b in taken], cfg.micro_batch_size,
                                      cfg.tensor_model_parallel_size)
        metrics = run.engine.train_step(mbs, sft_loss_fn(arch.vocab_size, total, backend))
        consumed += len(taken)
        metrics.update(epoch=taken[-1][0], consumed_bins=consumed,
                       samples=[i for _, b in taken for i in b])
        return metrics

    history = run_steps(cfg, run.engine, log, run.step, take_step,
                        lambda m: {"consumed_bins": m["consumed_bins"]})
    finish(cfg, run.engine, log)
    return history


def memory_workload(cfg: SFTConfig) -> Workload:
    """What the SFT trainer feeds the model: THD packs of bins of ``bin_size`` tokens (no
    attention mask), under the fused log-prob loss unless --loss-backend torch."""
    return Workload(cfg.bin_size, fused_loss=cfg.loss_backend != "torch")


def main(argv: Sequence[str] | None = None) -> None:
    """``klear-sft``: parse flags, run SFT, exit non-zero with a clear message on bad input."""
    from megatron_klear.train.main import trainer_main

    trainer_main(SFTConfig, train, argv, "klear-sft", workload=memory_workload)


if __name__ == "__main__":
    main()
