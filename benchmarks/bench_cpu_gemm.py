"""The CPU kernels behind a training step, against what torch runs without them, one thread.

  PYTHONPATH=. python benchmarks/bench_cpu_gemm.py [--tokens 1000] [--update-docs]

(1) GEMMs: each linear layer of the bench's tiny Qwen3 (hidden 128, intermediate 256, 4 query
and 2 KV heads of 32, vocab 103) in its three products -- forward ``x @ w.t()``, input gradient
``g @ w``, weight gradient ``g.t() @ x`` -- over a pack of about ``--tokens`` tokens that changes
length every call, as THD packs do: torch's matmul (MKL's sgemm) against ``klear::onednn_mm``
(oneDNN in fixed pieces, platform.cpu_matmul), and oneDNN called whole on lengths that never
repeat, as in a run (it builds and caches a kernel for every new length: slower here, and in a
training process 1-15 ms per new length and unbounded memory). Then the embedded server's decode
projections at 64 rows: MKL, ``klear::onednn_mm`` and oneDNN's linear (platform.onednn_linear),
and a whole step's, unfused through MKL against fused through oneDNN. (2) RMSNorm forward + backward
of a pack's hidden states and q heads: torch's ``F.rms_norm`` and autograd against
``ops.rms_norm``. Each number is the median of 5 rounds; ``--update-docs`` writes the tables into
docs/results.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_klear import _C, platform  # noqa: E402
from megatron_klear.ops.rms_norm import rms_norm  # noqa: E402
from results_doc import write_block  # noqa: E402  (benchmarks/, the script's folder)

# (in, out) of each linear layer: fused qkv, attention output, fc1 (gate|up), fc2, lm_head
LINEARS = {"qkv": (128, 256), "proj": (128, 128), "fc1": (128, 512), "fc2": (256, 128),
           "lm_head": (128, 103)}


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def _median(fn, calls: int, rounds: int = 5) -> float:
    fn(0)
    return statistics.median(_seconds(fn, calls) for _ in range(rounds))


def gemm_rows(tokens: int) -> list[tuple[str, float, float, float]]:
    """(product, MKL s, onednn_mm s, whole oneDNN s) per linear layer and product."""
    whole = torch.ops.mkldnn._linear_pointwise
    rng = random.Random(0)
    lengths = [tokens + rng.randrange(-tokens // 10, tokens // 10) for _ in range(64)]
    fresh = iter(range(tokens + tokens // 10, 10 * tokens))  # lengths never seen before
    rows = []
    for name, (k, n) in LINEARS.items():
        w = torch.randn(n, k)
        x, g = torch.randn(max(lengths), k), torch.randn(max(lengths), n)
        products = {
            "forward": (lambda m: x[:m] @ w.t(),
                        lambda m: platform.cpu_matmul(x[:m], w.t()),
                        lambda m: whole(x[:m], w, None, "none", [], "")),
            "input grad": (lambda m: g[:m] @ w,
                           lambda m: platform.cpu_matmul(g[:m], w),
                           lambda m: whole(g[:m], w.t(), None, "none", [], "")),
            "weight grad": (lambda m: g[:m].t() @ x[:m],
                            lambda m: platform.cpu_matmul(g[:m].t(), x[:m]),
                            lambda m: whole(g[:m].t(), x[:m].t(), None, "none", [], "")),
        }
        for product, fns in products.items():
            times = [_median(lambda i, f=f: f(lengths[i % len(lengths)]), 16) for f in fns[:2]]
            times.append(_median(lambda i, f=fns[2]: f(next(fresh) // 2 + tokens // 2), 16))
            rows.append((f"{name} {product} ({k}->{n})", *times))
    return rows


def decode_rows() -> list[tuple[str, float, float, float]]:
    """(projection, F.linear s, onednn_mm s, oneDNN linear s) at a 64-row decode step, then
    a whole step's projections (4 layers and lm_head): unfused through F.linear, as the
    decode ran them before, against fused through oneDNN's linear, as it runs them now."""
    mm, linear = platform._onednn_mm(), platform.onednn_linear()
    rows = []
    for name, (k, n) in LINEARS.items():
        x, w = torch.randn(64, k), torch.randn(n, k)
        rows.append((f"{name} (64 x {k} -> {n})",
                     _median(lambda i: torch.nn.functional.linear(x, w), 400),
                     _median(lambda i: mm(x, w.t()), 400),
                     _median(lambda i: linear(x, w), 400)))
    x, h = torch.randn(64, 128), torch.randn(64, 256)
    unfused = [(x, torch.randn(n, 128)) for n in (128, 64, 64, 128, 256, 256)] + \
        [(h, torch.randn(128, 256))]
    fused = [(x, torch.randn(256, 128)), (x, torch.randn(128, 128)), (x, torch.randn(512, 128)),
             (h, torch.randn(128, 256))]
    head = (x, torch.randn(103, 128))

    def step(pairs, fn):
        return lambda i: [fn(a, b) for a, b in pairs * 4 + [head]]
    rows.append(("a step's projections: 4 x (q, k, v, o, gate, up, down) + lm_head, against "
                 "4 x (q|k|v, o, gate|up, down) + lm_head",
                 _median(step(unfused, torch.nn.functional.linear), 100), float("nan"),
                 _median(step(fused, linear), 100)))
    return rows


def norm_rows(tokens: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, shape in (("hidden states", (tokens, 1, 128)), ("q heads", (tokens, 1, 4, 32))):
        x = torch.randn(*shape, requires_grad=True)
        w = torch.ones(shape[-1], requires_grad=True)
        dy = torch.randn(*shape)

        def torch_norm(i):
            torch.nn.functional.rms_norm(x, w.shape, w, 1e-6).backward(dy)

        def fused(i):
            rms_norm(x, w, 1e-6).backward(dy)

        rows.append((f"{name} {list(shape)}", _median(torch_norm, 50), _median(fused, 50)))
    return rows


def report(tokens: int) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
             f"{torch.__version__}, 1 thread, oneDNN GEMM "
             f"{'on' if platform._onednn_mm() else 'unavailable'} (`python "
             f"benchmarks/bench_cpu_gemm.py --tokens {tokens}`).", "",
             f"| GEMM, packs of ~{tokens} tokens of varying length | MKL (torch) us | "
             "klear::onednn_mm us | MKL / onednn_mm | oneDNN whole us |", "|---|---|---|---|---|"]
    total = [0.0, 0.0]
    for name, mkl, ours, whole in gemm_rows(tokens):
        lines.append(f"| {name} | {mkl * 1e6:.0f} | {ours * 1e6:.0f} | **{mkl / ours:.2f}x** | "
                     f"{whole * 1e6:.0f} |")
        total[0] += mkl
        total[1] += ours
    lines.append(f"| all 15 | {total[0] * 1e6:.0f} | {total[1] * 1e6:.0f} | "
                 f"**{total[0] / total[1]:.2f}x** | |")
    lines += ["", "| decode projection, 64 rows | F.linear (MKL) us | klear::onednn_mm us | "
              "oneDNN linear us (the decode's) | MKL / oneDNN linear |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {a * 1e6:.1f} | {b * 1e6:.1f} | {c * 1e6:.1f} | **{a / c:.2f}x** |"
              .replace("| nan |", "| |") for name, a, b, c in decode_rows()]
    lines += ["", "| RMSNorm forward + backward | torch us | ops.rms_norm us | ratio |",
              "|---|---|---|---|"]
    lines += [f"| {name} | {a * 1e6:.0f} | {b * 1e6:.0f} | **{a / b:.1f}x** |"
              for name, a, b in norm_rows(tokens)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000,
                        help="tokens per pack (a rank's micro-batch in bench_vs_trl.py: ~1000)")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the tables into docs/results.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    assert _C.onednn_gemm, "this torch has no oneDNN fp32 matmul"
    text = report(args.tokens)
    print(text)
    if args.update_docs:
        write_block("bench_cpu_gemm", text)


if __name__ == "__main__":
    main()
