"""Fused policy-loss op at TP=1: every fused backend against the torch reference, plus
hand-computed values for the GPPO / PPO / CISPO tables (dual clip, ERC) through the whole op
(logits -> loss -> dlogits).
``cuda-emu`` runs the CUDA kernel source on the CPU (tests/cuda_emu.py); vocab 320 takes its
16-byte vector kernels, 301 its scalar fallback."""

import pytest
import torch

from megatron_klear.ops import vocab_parallel as op_module
from megatron_klear.ops import PolicyLossSpec, vocab_parallel_logprobs, vocab_parallel_policy_loss
from tests.cuda_emu import backend_for
from tests.policy_loss_cases import (FUSED, HAND_SETTINGS, assert_match, hand_table,
                                     make_inputs, run_hand_table, run_op)

SETTINGS = [dict(loss_type="gppo"), dict(loss_type="gppo", beta1=0.5, beta2=2.0, dual_clip=3.0),
            dict(loss_type="ppo", dual_clip=3.0), dict(loss_type="cispo"),
            dict(loss_type="gppo", beta1=0.75, dual_clip=3.0, entropy_ratio_clip=0.1),
            dict(loss_type="cispo", entropy_ratio_clip=0.1, vocab_size=250),
            dict(loss_type="gppo", temperature=0.7), dict(loss_type="gppo", vocab_size=250)]


@pytest.mark.parametrize("device,backend", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("vocab", [301, 320])
def test_fused_matches_reference(device, backend, dtype, kw, vocab):
    inp = make_inputs(48, vocab, vocab_size=kw.get("vocab_size"))
    logits = inp["logits"].to(dtype)
    ref = run_op(inp, logits, backend="torch", device=device, **kw)
    got = run_op(inp, logits, backend=backend, device=device, **kw)
    assert_match(got, ref, dtype, f"{backend} {dtype} {kw}")
    if "vocab_size" in kw:  # padded slots get exactly zero gradient
        assert torch.count_nonzero(got["grad"][:, kw["vocab_size"]:]) == 0


@pytest.mark.parametrize("device,backend", FUSED)
def test_batched_shape_per_sequence_advantages_and_empty_mask(device, backend):
    inp = make_inputs(24, 130, empty_mask=True)
    logits = inp["logits"].view(4, 6, 130)
    inp = {k: (v.view(4, 6) if k != "logits" else v) for k, v in inp.items()}
    inp["adv"] = inp["adv"][:, 0]                               # one advantage per sequence
    ref = run_op(inp, logits, backend="torch", device=device, temperature=1.3)
    got = run_op(inp, logits, backend=backend, device=device, temperature=1.3)
    assert_match(got, ref, torch.float32, "batched, empty mask")
    assert got["loss"].item() == 0 and got["logprobs"].shape == (4, 6)


@pytest.mark.parametrize("device,backend", FUSED + [("cpu", "torch")])
@pytest.mark.parametrize("loss_type,beta1,beta2,erc", HAND_SETTINGS,
                         ids=lambda v: str(v))
def test_loss_table_by_hand_through_the_op(device, backend, loss_type, beta1, beta2, erc):
    """Loss and dloss/dlogits per case of the GPPO / PPO / CISPO tables, with the dual clip and
    ERC, from math.exp/log (tests/policy_loss_cases.hand_table), not from the code."""
    table = hand_table(loss_type, beta1, beta2, erc)
    loss, grad, ratio = run_hand_table(table, table["logits"], backend=backend, device=device)
    assert loss.item() == pytest.approx(table["loss"], abs=1e-6)
    torch.testing.assert_close(grad, table["grad"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ratio, table["ratio"])
    if loss_type == "ppo":   # clipped tokens: exactly zero gradient
        assert torch.count_nonzero(grad[:3]) == 0
    if erc is not None:      # ERC's rows: exactly zero gradient; the others do get one
        assert torch.count_nonzero(grad[[1, 3]]) == 0 and torch.count_nonzero(grad[[0, 4]]) > 0
        no_erc = hand_table(loss_type, beta1, beta2, None)
        assert table["loss"] == no_erc["loss"] and not torch.equal(table["grad"], no_erc["grad"])


@pytest.mark.parametrize("device,backend", FUSED)
def test_inplace_backward_writes_the_gradient_into_the_logits(device, backend):
    inp = make_inputs(16, 97)
    ref = run_op(inp, inp["logits"], backend=backend, device=device)
    buf = inp["logits"].clone().to(device).requires_grad_(True)
    dev = {k: v.to(device) for k, v in inp.items()}
    with backend_for(backend) as used:
        out = vocab_parallel_policy_loss(buf, dev["targets"], dev["old"], dev["adv"],
                                         dev["mask"], backend=used, inplace_backward=True)
        grad, = torch.autograd.grad(out.loss + (dev["w_logp"] * out.logprobs).sum(), buf)
    torch.testing.assert_close(buf.detach().cpu(), grad.cpu(), rtol=0, atol=0)  # same storage
    no_ent = run_op({**inp, "w_ent": torch.zeros(16)}, inp["logits"], backend=backend,
                    device=device)
    torch.testing.assert_close(grad.cpu(), no_ent["grad"], rtol=1e-6, atol=1e-7)
    assert not torch.equal(ref["grad"], no_ent["grad"])  # control: the entropy term matters


def test_cpu_kernels_are_deterministic_across_thread_counts():
    inp = make_inputs(64, 4099)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_op(inp, inp["logits"], backend="cpu")
        torch.set_num_threads(2)
        two = run_op(inp, inp["logits"], backend="cpu")
    finally:
        torch.set_num_threads(threads)
    for key in one:
        assert torch.equal(one[key], two[key]), key


@pytest.mark.parametrize("device,backend", FUSED)
def test_logprobs_pass_matches_reference_without_grad(device, backend):
    inp = make_inputs(20, 203, vocab_size=200)
    x = inp["logits"].to(device).requires_grad_(True)
    t = inp["targets"].to(device)
    with backend_for(backend) as used:
        got = vocab_parallel_logprobs(x, t, None, True, temperature=0.8, vocab_size=200,
                                      backend=used)
        no_entropy = vocab_parallel_logprobs(x, t, backend=used)[1]
    ref = vocab_parallel_logprobs(x, t, None, True, temperature=0.8, vocab_size=200,
                                  backend="torch")
    assert not got[0].requires_grad and not got[1].requires_grad
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.cpu(), r.cpu(), rtol=1e-5, atol=1e-5)
    assert no_entropy is None


def test_bad_inputs_raise_clear_errors(monkeypatch):
    inp = make_inputs(4, 10)
    args = (inp["logits"], inp["targets"], inp["old"], inp["adv"], inp["mask"])
    in_range = "target_ids must be global token ids in \\[0, 8\\)"
    for bad in ([0, 1, 9, 2], [0, -1, 3, 2]):   # checked on the device, without a host sync
        with pytest.raises(RuntimeError, match=in_range):
            vocab_parallel_policy_loss(inp["logits"], torch.tensor(bad), *args[2:], vocab_size=8)
    with pytest.raises(ValueError, match="inplace_backward=True needs contiguous logits"):
        vocab_parallel_policy_loss(inp["logits"].t().contiguous().t(), *args[1:],
                                   inplace_backward=True)
    monkeypatch.setenv("KLEAR_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="KLEAR_CPU_ISA='avx9000' names no CPU kernel copy: "
                                         "use one of base, avx2, avx512, avx512bf16"):
        vocab_parallel_policy_loss(*args, backend="cpu")
    monkeypatch.delenv("KLEAR_CPU_ISA")
    with pytest.raises(ValueError, match="vocab_size=11"):
        vocab_parallel_policy_loss(*args, vocab_size=11)
    with pytest.raises(ValueError, match="advantages must be shaped"):
        vocab_parallel_policy_loss(*args[:3], torch.zeros(3), args[4])
    with pytest.raises(ValueError, match="loss_mask must be shaped like the targets"):
        vocab_parallel_policy_loss(*args[:4], torch.ones(2, 2))
    with pytest.raises(ValueError, match="unknown policy loss"):
        vocab_parallel_policy_loss(*args, PolicyLossSpec(loss_type="grpo"))
    with pytest.raises(ValueError, match="entropy_ratio_clip needs old_entropy"):
        vocab_parallel_policy_loss(*args, PolicyLossSpec(entropy_ratio_clip=0.05))
    with pytest.raises(ValueError, match="entropy_ratio_clip \\(ERC delta\\) must be > 0"):
        vocab_parallel_policy_loss(*args, PolicyLossSpec(entropy_ratio_clip=0.0),
                                   old_entropy=inp["old_ent"])
    with pytest.raises(ValueError, match="old_entropy must be shaped like the targets"):
        vocab_parallel_policy_loss(*args, PolicyLossSpec(entropy_ratio_clip=0.05),
                                   old_entropy=torch.ones(3))
    with pytest.raises(ValueError, match="backend must be one of"):
        vocab_parallel_policy_loss(*args, backend="triton")
    monkeypatch.setattr(op_module, "_extension_ops", lambda: None)  # as if _C were not built
    with pytest.raises(RuntimeError, match="build_ext --inplace"):
        vocab_parallel_policy_loss(*args, backend="cpu")
    assert op_module.resolve_backend("auto", "cpu") == "torch"


@pytest.mark.parametrize("device,backend", FUSED)
def test_python_registered_loss_runs_on_fused_logprobs(device, backend):
    """A loss registered only in Python uses the kernels' log-probs and torch per-token math."""
    from megatron_klear.ops.loss_math import POLICY_LOSSES, gppo_loss, register_policy_loss

    register_policy_loss("gppo_python_copy")(gppo_loss)
    try:
        inp = make_inputs(32, 157)
        got = run_op(inp, inp["logits"], backend=backend, device=device,
                     loss_type="gppo_python_copy", dual_clip=2.5)
        ref = run_op(inp, inp["logits"], backend="torch", device=device, loss_type="gppo",
                     dual_clip=2.5)
        assert_match(got, ref, torch.float32, "python-registered loss")
    finally:
        del POLICY_LOSSES["gppo_python_copy"]


@pytest.mark.parametrize("device,backend", FUSED)
def test_logits_shared_with_another_loss_term(device, backend):
    """The out-of-place backward leaves the logits intact for other terms that saved them."""
    inp = {k: v.to(device) for k, v in make_inputs(12, 64).items()}
    grads = []
    for b in (backend, "torch"):
        x = inp["logits"].clone().requires_grad_(True)
        y = x * 1.0
        with backend_for(b) as used:
            out = vocab_parallel_policy_loss(y, inp["targets"], inp["old"], inp["adv"],
                                             inp["mask"], backend=used)
            (out.loss + 1e-3 * (y ** 2).sum()).backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,backend", FUSED)
def test_minus_inf_logits_give_finite_outputs(device, backend):
    """Logits masked to -inf by the caller (not padding) behave as probability 0."""
    inp = make_inputs(16, 80)
    inp["logits"][:, 40:50] = float("-inf")
    inp["targets"] = inp["targets"] % 40
    ref = run_op(inp, inp["logits"], backend="torch", device=device, temperature=0.9)
    got = run_op(inp, inp["logits"], backend=backend, device=device, temperature=0.9)
    assert_match(got, ref, torch.float32, "-inf logits")
    assert torch.count_nonzero(got["grad"][:, 40:50]) == 0


def test_kernel_ops_check_every_input():
    """torch.ops.klear rejects per-row inputs of the wrong size, dtype or device by name."""
    from megatron_klear import _C  # noqa: F401  (registers torch.ops.klear)
    ops = torch.ops.klear
    inp = make_inputs(6, 40)
    x, t = inp["logits"], inp["targets"]
    stats = ops.logprob_stats(x, t, 40, 1.0)
    lse, ent, gl = stats[:, 0].contiguous(), stats[:, 1].contiguous(), torch.ones(6)
    assert ops.logprob_backward(x, t, lse, ent, gl, None, 40, 1.0).shape == x.shape
    bad = {"lse": (lse[:5], ent, gl, None), "entropy": (lse, ent.double(), gl, None),
           "grad_logp": (lse, ent, torch.ones(7), None),
           "grad_entropy": (lse, ent, gl, torch.ones(6, dtype=torch.int32))}
    for name, rows in bad.items():
        for backward in (ops.logprob_backward, ops.logprob_backward_):
            with pytest.raises(RuntimeError, match=f"klear: {name} must be a float32 tensor"):
                backward(x.clone(), t, *rows, 40, 1.0)
    with pytest.raises(RuntimeError, match="target_local must be a contiguous int64"):
        ops.logprob_stats(x, t[:5], 40, 1.0)
    with pytest.raises(RuntimeError, match="valid vocab slots"):
        ops.logprob_stats(x, t, 41, 1.0)
    with pytest.raises(RuntimeError, match="logits must be a contiguous"):
        ops.logprob_stats(x.t(), t, 6, 1.0)
    tok = (torch.zeros(6), torch.zeros(6), torch.ones(6))
    hyper = (1, 0.2, 0.28, 1.0, 1.0, -1.0)
    assert ops.token_policy_loss(*tok, torch.ones(6), torch.ones(6), *hyper, 0.95,
                                 1.05)[0].shape == (6,)
    with pytest.raises(RuntimeError, match="needs entropy and old_entropy exactly when"):
        ops.token_policy_loss(*tok, None, None, *hyper, 0.95, 1.05)
    with pytest.raises(RuntimeError, match="needs entropy and old_entropy exactly when"):
        ops.token_policy_loss(*tok, torch.ones(6), torch.ones(6), *hyper, 0.0, -1.0)
    with pytest.raises(RuntimeError, match="entropy and old_entropy must be contiguous float32"):
        ops.token_policy_loss(*tok, torch.ones(6), torch.ones(5), *hyper, 0.95, 1.05)


@pytest.mark.parametrize("device,backend", FUSED + [("cpu", "torch")])
def test_erc_band_and_log_ratio_clamp_by_hand_through_the_op(device, backend):
    """ERC with the free band (0.9, 1.3) and ERC's clamp of log r to [-20, 20], through the
    whole op: rows (log r, A, H / H_old) = (+25, 1, 1): high clip at the clamped ratio e^20,
    value -1.28, no gradient; (-25, -1, 1): low clip, value 0.8, no gradient; (log 1.1, 0.7,
    1.2): kept (a symmetric delta 0.1 would drop it); (log 1.1, 0.7, 0.85): dropped;
    (log 0.9, -0.3, 1): kept. Expected values from math.exp/log (policy_loss_cases)."""
    import math

    from tests.policy_loss_cases import HAND_ROWS, HAND_TARGETS, _hand_row
    log_r = [25.0, -25.0, math.log(1.1), math.log(1.1), math.log(0.9)]
    adv, rho = [1.0, -1.0, 0.7, 0.7, -0.3], [1.0, 1.0, 1.2, 0.85, 1.0]
    rows = [_hand_row(row, t) for row, t in zip(HAND_ROWS, HAND_TARGETS)]
    old = torch.tensor([lp - lr for (lp, _, _), lr in zip(rows, log_r)])
    old_ent = torch.tensor([h / q for (_, _, h), q in zip(rows, rho)])
    values = [-1.28, 0.8, -1.1 * 0.7, -1.1 * 0.7, 0.9 * 0.3]
    dlogp = [0.0, 0.0, -1.1 * 0.7, 0.0, 0.9 * 0.3]
    grad = torch.tensor([[d / 5 * ((j == t) - q) for j, q in enumerate(p)]
                         for d, (_, p, _), t in zip(dlogp, rows, HAND_TARGETS)])
    x = torch.tensor(HAND_ROWS, device=device, requires_grad=True)
    with backend_for(backend) as used:
        out = vocab_parallel_policy_loss(
            x, torch.tensor(HAND_TARGETS, device=device), old.to(device),
            torch.tensor(adv, device=device), torch.ones(5, device=device),
            PolicyLossSpec("gppo", erc_low=0.9, erc_high=1.3), old_entropy=old_ent.to(device),
            backend=used)
        out.loss.backward()
    assert out.loss.item() == pytest.approx(sum(values) / 5, abs=1e-6)
    torch.testing.assert_close(x.grad.cpu(), grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(x.grad[[0, 1, 3]]) == 0
    assert out.ratio[0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
