"""Fused policy-loss CUDA kernels on a GPU: rows beyond 2^31 / 2^32 elements, and achieved
memory bandwidth per kernel against the device's HBM peak, with the issue-16 threshold.

Standalone on purpose (run by tests/gpu/run_gpu_checks.sh): needs only python3, CUDA torch and
the extension built in place (megatron_klear/_C*.so, loaded directly: no package import, no
megatron). NOT RUN YET: no GPU has been lent to this project so far.

Traffic model (bf16, per logit): stats reads 2 B, the in-place backward reads 2 B and writes 2 B,
so fwd+bwd moves 6 B; a device-to-device copy of the same bytes is measured alongside.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# HBM peak (GB/s) by device-name fragment, first match wins.
PEAK_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0)]
THRESHOLD = 0.85          # fwd+bwd >= 85% of the HBM peak at T=32768, V/TP=151,936 bf16
THRESHOLD_DEVICES = ("H100", "H200")
BOUNDARY_ROWS = [14133, 14134, 14135, 28267, 28268, 28269]   # straddle 2^31 and 2^32 elements
COPY, FUSED = "copy (d2d, reference)", "fwd+bwd (stats + backward)"


def load_ops():
    """torch.ops.klear from this interpreter's build of the extension (a checkout may hold
    builds for several Python versions)."""
    so = ROOT / "megatron_klear" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not so.is_file():
        sys.exit(f"kernel_bandwidth: no {so.name}: build the extension first (python3 setup.py "
                 "build_ext --inplace)")
    torch.ops.load_library(str(so))
    return torch.ops.klear


def peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after a warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def check_boundary_rows(ops, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Stats + in-place gradient of rows around 2^31 / 2^32 elements vs an fp64 reference."""
    rows = torch.tensor(BOUNDARY_ROWS, device=logits.device)
    saved = logits[rows].double()
    vocab = logits.shape[1]
    stats = ops.logprob_stats(logits, targets, vocab, 1.0)
    m, d, s = stats[:, 0], stats[:, 1], stats[:, 2]
    lse = m + torch.log(d)
    entropy = torch.log(d) - s / d
    g_logp = torch.ones(logits.shape[0], device=logits.device)
    g_ent = torch.full_like(g_logp, 0.5)
    ops.logprob_backward_(logits, targets, lse, entropy, g_logp, g_ent, vocab, 1.0)
    ref_lse = torch.logsumexp(saved, -1)
    logp = saved - ref_lse[:, None]
    p = logp.exp()
    ref_h = -(p * logp).sum(-1)
    onehot = torch.nn.functional.one_hot(targets[rows], vocab).double()
    ref_grad = (onehot - p) - 0.5 * p * (logp + ref_h[:, None])
    lse_err = (lse[rows].double() - ref_lse).abs().max().item()
    h_err = (entropy[rows].double() - ref_h).abs().max().item()
    grad_err = (logits[rows].double() - ref_grad).abs().max().item()
    print(f"rows {BOUNDARY_ROWS} (2^31 / 2^32 boundary): |lse err| {lse_err:.2e}, "
          f"|H err| {h_err:.2e}, |grad err| {grad_err:.2e}")
    if not (lse_err < 1e-4 and h_err < 1e-4 and grad_err < 2e-3):
        sys.exit("kernel_bandwidth: FAIL: wrong results on rows beyond 2^31 elements")


def measure(ops, tokens: int, vocab: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{kernel: (median seconds, achieved GB/s)} at ``tokens`` x ``vocab`` bf16 logits, the
    device-to-device copy of the same bytes measured in the same run first; the rows beyond
    2^31 / 2^32 elements are checked against fp64 when the logits reach them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, v = tokens, vocab
    logits = (torch.randn(t, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device="cuda", generator=g)
    if t * v > 2**32:
        check_boundary_rows(ops, logits, targets)
    per_row = [torch.rand(t, device="cuda") + 10, torch.rand(t, device="cuda"),
               torch.randn(t, device="cuda"), torch.randn(t, device="cuda")]
    logit_bytes = logits.numel() * logits.element_size()
    copy_dst = torch.empty_like(logits)
    kernels = {
        COPY: (lambda: copy_dst.copy_(logits), 2 * logit_bytes),
        "stats": (lambda: ops.logprob_stats(logits, targets, v, 1.0), logit_bytes),
        "backward in place": (lambda: ops.logprob_backward_(logits, targets, *per_row, v, 1.0),
                              2 * logit_bytes),
        FUSED: (
            lambda: (ops.logprob_stats(logits, targets, v, 1.0),
                     ops.logprob_backward_(logits, targets, *per_row, v, 1.0)), 3 * logit_bytes),
    }
    out = {}
    for label, (fn, nbytes) in kernels.items():
        sec = timed(fn, repeats)
        out[label] = (sec, nbytes / sec / 1e9)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=151936, help="V/TP")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernel_bandwidth: needs a CUDA GPU and CUDA torch")
    ops = load_ops()
    name = torch.cuda.get_device_name()
    peak = peak_gbps(name)
    print(f"device: {name}; HBM peak {peak or 'unknown'} GB/s; T={args.tokens} "
          f"V/TP={args.vocab} bf16")
    achieved = measure(ops, args.tokens, args.vocab, args.repeats)
    print("| kernel | ms | GB/s | vs HBM peak | vs measured copy |")
    print("|---|---|---|---|---|")
    for label, (sec, gbps) in achieved.items():
        vs_peak = f"{gbps / peak:.1%}" if peak else "-"
        print(f"| {label} | {sec * 1e3:.2f} | {gbps:.0f} | {vs_peak} | "
              f"{gbps / achieved[COPY][1]:.1%} |")
    fused = achieved[FUSED][1]
    if any(d in name for d in THRESHOLD_DEVICES) and peak:
        ok = fused >= THRESHOLD * peak
        print(f"threshold: fwd+bwd {fused / peak:.1%} of HBM peak, target >= {THRESHOLD:.0%}: "
              f"{'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    print(f"threshold: not applied on {name} (target set for {', '.join(THRESHOLD_DEVICES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
