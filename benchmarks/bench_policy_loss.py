"""Benchmark the vocab-parallel GPPO loss: fused backends vs the torch reference vs Megatron.

For each (tokens T, vocab shard V/TP) row, measures forward+backward wall time and the peak
EXTRA memory (above the logits already in memory) of:

* ``torch``:    the reference backend of megatron_klear.ops (full fp32 log_softmax);
* ``megatron``: the unfused Megatron path: fp32 upcast +
                tensor_parallel.vocab_parallel_cross_entropy, then the GPPO per-token loss on -CE;
* ``cpu`` / ``cuda``: the fused kernels, plus ``*-inplace`` (gradient written into the logits).

All methods run side by side in one process at TP=1, so the printed ratios compare like with
like. On CPU, peak memory is the peak RSS (sampled by a thread every 0.2 ms) minus the RSS
before the call; on GPU it is torch.cuda.max_memory_allocated minus the allocation before.
Every row also prints the achieved bandwidth for 3 x the logits bytes (6 x V/TP bytes per token
in bf16: read in forward, read + write in backward) and its ratio to the copy bandwidth of the
same machine, measured in the same run (best of --repeats copies of the logits into a second,
pre-touched buffer: 2 x the logits bytes moved); GPU rows add the ratio to --peak-gbps.
Rows whose reference would need more than --max-gib are skipped with a message. Example:

    python benchmarks/bench_policy_loss.py --tokens 1024 4096 --vocab 37984 151936
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

import torch
from tqdm import tqdm

from megatron_klear.algo.losses import aggregate, per_token_policy_loss
from megatron_klear.ops import available_backends, vocab_parallel_policy_loss

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Peak extra bytes per logit of the reference backend (measured ~12 with bf16 logits), plus margin
REFERENCE_BYTES_PER_LOGIT = 16


def _init_megatron_tp1() -> None:
    """torch.distributed (1 rank, free port) + megatron parallel state at TP=1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    from megatron_klear.train.engine import initialize_parallel
    initialize_parallel(tp=1, pp=1)


def _megatron_unfused(logits, targets, old, adv, mask):
    """The path RL frameworks use today: fp32 upcast, Megatron vocab-parallel CE, GPPO on -CE."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    logp = -vocab_parallel_cross_entropy(logits.float()[None], targets[None])[0]
    return aggregate(per_token_policy_loss("gppo", logp, old, adv), mask)


class _PeakRss:
    """Peak resident set size above the value at entry, sampled by a background thread."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _step(method: str, inputs: dict) -> None:
    """One forward + backward of ``method``; the gradient is dropped afterwards."""
    logits = inputs["logits"].detach().requires_grad_(True)
    args = (inputs["targets"], inputs["old"], inputs["adv"], inputs["mask"])
    if method == "megatron":
        loss = _megatron_unfused(logits, *args)
    else:
        backend = method.removesuffix("-inplace")
        loss = vocab_parallel_policy_loss(logits, *args, backend=backend,
                                          inplace_backward=method.endswith("-inplace")).loss
    loss.backward()
    del logits, loss


def _measure(method: str, inputs: dict, repeats: int) -> tuple[float, int]:
    """(best seconds, peak extra bytes) over ``repeats`` timed runs after one warm-up."""
    cuda = inputs["logits"].is_cuda
    best, peak = float("inf"), 0
    for i in range(repeats + 1):
        fresh = dict(inputs, logits=inputs["logits"].clone()) if method.endswith("inplace") \
            else inputs
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with _PeakRss() as rss:
            start = time.perf_counter()
            _step(method, fresh)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        extra = torch.cuda.max_memory_allocated() - base if cuda else rss.extra
        if i > 0:
            best, peak = min(best, elapsed), max(peak, extra)
        del fresh
    return best, peak


def _copy_gbps(logits: torch.Tensor, repeats: int) -> float:
    """Copy bandwidth (read + write bytes / s) of ``logits`` into a pre-touched buffer, best of
    ``repeats`` after a warm-up: the machine's own memory-bandwidth yardstick."""
    dst = torch.empty_like(logits)
    best = float("inf")
    for i in range(repeats + 1):
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(logits)
        if logits.is_cuda:
            torch.cuda.synchronize()
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return 2 * logits.numel() * logits.element_size() / best / 1e9


def _inputs(tokens: int, vocab: int, dtype: torch.dtype, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g, dtype=torch.float32) * 2).to(dtype)
    return dict(logits=logits.to(device),
                targets=torch.randint(0, vocab, (tokens,), generator=g).to(device),
                old=(-torch.rand(tokens, generator=g) * 8).to(device),
                adv=torch.randn(tokens, generator=g).to(device),
                mask=(torch.rand(tokens, generator=g) > 0.1).to(device))


def _methods(device: str) -> list[str]:
    fused = [b for b in available_backends(device) if b != "torch"]
    return ["torch", "megatron"] + fused + [f"{b}-inplace" for b in fused]


def _row(tokens: int, vocab: int, args, methods: list[str]) -> list[str]:
    need_gib = tokens * vocab * REFERENCE_BYTES_PER_LOGIT / 2**30
    if need_gib > args.max_gib:
        return [f"| {tokens} | {vocab} | skipped: the reference needs ~{need_gib:.0f} GiB "
                f"> --max-gib {args.max_gib} | | | | |"]
    inputs = _inputs(tokens, vocab, DTYPES[args.dtype], args.device)
    results = {m: _measure(m, inputs, args.repeats) for m in methods}
    copy_gbps = _copy_gbps(inputs["logits"], args.repeats)
    ref_t, ref_m = results.get("torch", (1.0, 1))
    meg_t, meg_m = results.get("megatron", (1.0, 1))
    traffic = 3 * inputs["logits"].element_size() * vocab * tokens   # 6 B/logit in bf16
    lines = []
    for m, (t, mem) in results.items():
        gbps = traffic / t / 1e9
        bw = f"{gbps:.1f} GB/s = {gbps / copy_gbps:.0%} of copy ({copy_gbps:.1f} GB/s)"
        if args.device == "cuda":
            bw += f", {gbps / args.peak_gbps:.0%} of {args.peak_gbps:.0f} GB/s peak"
        vs = "-" if "torch" not in results or "megatron" not in results else \
            f"{ref_t / t:.2f}x / {meg_t / t:.2f}x | " \
            f"{mem / max(ref_m, 1):.3f} / {mem / max(meg_m, 1):.3f}"
        lines.append(f"| {tokens} | {vocab} | {m} | {t * 1e3:.1f} | {mem / 2**20:.0f} | "
                     f"{vs if vs != '-' else '- | -'} | {bw} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--vocab", type=int, nargs="+", default=[37984, 151936],
                   help="vocabulary columns per TP rank (V/TP)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per method (best is kept)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="subset of the methods to run (default: all); the ratio columns need "
                        "torch and megatron")
    p.add_argument("--max-gib", type=float, default=12.0,
                   help="skip rows whose reference would need more memory than this")
    p.add_argument("--peak-gbps", type=float, default=4800.0,
                   help="device memory bandwidth for the GPU %% column (H200: 4800)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_policy_loss: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    _init_megatron_tp1()
    methods = _methods(args.device)
    if args.methods:
        methods = [m for m in methods if m in args.methods]
    print(f"# device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"methods={methods}")
    print("| T | V/TP | method | fwd+bwd ms | peak extra MiB | speed-up vs torch / megatron | "
          "memory vs torch / megatron | bandwidth (3 x logits bytes) vs copy |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(t, v) for t in args.tokens for v in args.vocab]
    for tokens, vocab in tqdm(rows, desc="rows", file=sys.stderr):
        for line in _row(tokens, vocab, args, methods):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
