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
pre-touched buffer: 2 x the logits bytes moved); GPU rows add the ratio to --peak-gbps, CPU rows
the cores the process actually got (process CPU seconds / wall seconds; on a shared machine
other jobs' load shows up as fewer cores than threads).
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

from megatron_klear.ops.loss_math import aggregate, per_token_policy_loss
from megatron_klear.ops import available_backends, vocab_parallel_policy_loss

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Peak extra bytes per logit of the reference backend (measured ~12 with bf16 logits), plus margin
REFERENCE_BYTES_PER_LOGIT = 16


def _init_megatron_tp1() -> None:
    """torch.distributed (1 rank, free port) + megatron parallel state at TP=1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    from megatron_klear.distributed import initialize_parallel
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


class _Best:
    """Best (smallest) wall and process-CPU seconds of the runs recorded with ``timed``."""

    def __init__(self, cuda: bool):
        self.cuda, self.wall, self.cpu = cuda, float("inf"), float("inf")

    def timed(self, fn, record: bool) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        if record:
            self.wall = min(self.wall, time.perf_counter() - wall)
            self.cpu = min(self.cpu, time.process_time() - cpu)


def _measure(method: str, inputs: dict, repeats: int) -> tuple[_Best, int]:
    """(best times over ``repeats`` runs after a warm-up, peak extra bytes of one more run).
    Memory is sampled in its own run so that the sampling thread does not slow the timed ones."""
    cuda = inputs["logits"].is_cuda
    best = _Best(cuda)
    for i in range(repeats + 2):
        fresh = dict(inputs, logits=inputs["logits"].clone()) if method.endswith("inplace") \
            else inputs
        if i <= repeats:
            best.timed(lambda: _step(method, fresh), record=i > 0)
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with _PeakRss() as rss:
            _step(method, fresh)
            if cuda:
                torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base if cuda else rss.extra
    return best, peak


def _copy(logits: torch.Tensor, repeats: int) -> _Best:
    """Best times of copying ``logits`` into a pre-touched buffer (2 x the logits bytes move):
    the machine's own memory-bandwidth yardstick, measured next to the methods."""
    dst = torch.empty_like(logits)
    best = _Best(logits.is_cuda)
    for i in range(repeats + 1):
        best.timed(lambda: dst.copy_(logits), record=i > 0)
    return best


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
    copy = _copy(inputs["logits"], args.repeats)
    logit_bytes = inputs["logits"].element_size() * vocab * tokens
    copy_gbps = 2 * logit_bytes / copy.wall / 1e9
    compare = "torch" in results and "megatron" in results
    if compare:
        (ref, ref_m), (meg, meg_m) = results["torch"], results["megatron"]
    lines = []
    for m, (best, mem) in results.items():
        gbps = 3 * logit_bytes / best.wall / 1e9   # 6 B/logit in bf16
        bw = f"{gbps:.1f} GB/s = {gbps / copy_gbps:.0%} of copy ({copy_gbps:.1f} GB/s)"
        if args.device == "cuda":
            bw += f", {gbps / args.peak_gbps:.0%} of {args.peak_gbps:.0f} GB/s peak"
        else:   # cores the process got (CPU s / wall s): below --threads = other jobs' load
            bw += f"; cores used {best.cpu / best.wall:.1f} (copy {copy.cpu / copy.wall:.1f})"
        vs = "- | -" if not compare else \
            f"{ref.wall / best.wall:.2f}x / {meg.wall / best.wall:.2f}x | " \
            f"{mem / max(ref_m, 1):.3f} / {mem / max(meg_m, 1):.3f}"
        lines.append(f"| {tokens} | {vocab} | {m} | {best.wall * 1e3:.1f} | {mem / 2**20:.0f} | "
                     f"{vs} | {bw} |")
    return lines


def _per_core(tokens: int, vocab: int, args) -> str:
    """CPU kernels and copy on ONE thread, timed by that thread's CPU time (time slicing by other
    jobs does not count): ns per logit, and the fwd+bwd : copy ratio projected for all
    ``--threads`` cores, assuming the kernels scale over rows and the copy stays on one core."""
    from megatron_klear import _C  # noqa: F401  (registers torch.ops.klear)
    ops = torch.ops.klear
    inputs = _inputs(tokens, vocab, DTYPES[args.dtype], "cpu")
    x, t = inputs["logits"], inputs["targets"]
    dst = x.clone()
    rows = [torch.full((tokens,), 12.0), torch.full((tokens,), 3.0), torch.randn(tokens),
            torch.randn(tokens)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def best(fn) -> float:
            times = []
            for _ in range(args.repeats + 1):
                start = time.thread_time()
                fn()
                times.append(time.thread_time() - start)
            return min(times[1:]) / x.numel() * 1e9
        stats = best(lambda: ops.logprob_stats(x, t, vocab, 1.0))
        backward = best(lambda: ops.logprob_backward_(dst, t, *rows, vocab, 1.0))
        copy = best(lambda: dst.copy_(x))
    finally:
        torch.set_num_threads(threads)
    ratio = (3 * x.element_size() / ((stats + backward) / threads)) / \
        (2 * x.element_size() / copy)
    return (f"# per core (1 thread, thread CPU time), T={tokens} V/TP={vocab}: stats {stats:.3f} "
            f"ns/logit, in-place backward {backward:.3f}, copy {copy:.3f} ns/element; projected "
            f"fwd+bwd on {threads} cores vs 1-core copy: {ratio:.0%}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--vocab", type=int, nargs="+", default=[37984, 151936],
                   help="vocabulary columns per TP rank (V/TP)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per method (best is kept)")
    p.add_argument("--per-core", action="store_true",
                   help="CPU: also time the kernels and the copy on one thread by its CPU time "
                        "(insensitive to other jobs on a shared machine) for each row")
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
    kernels = ""
    if args.device == "cpu" and "cpu" in available_backends("cpu"):
        from megatron_klear import _C
        kernels = f" cpu_kernels={_C.cpu_isa()}"   # the copy chosen at run time (csrc/cpu/)
    print(f"# device={args.device} dtype={args.dtype} threads={torch.get_num_threads()}"
          f"{kernels} methods={methods}")
    print("| T | V/TP | method | fwd+bwd ms | peak extra MiB | speed-up vs torch / megatron | "
          "memory vs torch / megatron | bandwidth (3 x logits bytes) vs copy |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(t, v) for t in args.tokens for v in args.vocab]
    for tokens, vocab in tqdm(rows, desc="rows", file=sys.stderr):
        for line in _row(tokens, vocab, args, methods):
            print(line, flush=True)
        if args.per_core and args.device == "cpu":
            print(_per_core(tokens, vocab, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
