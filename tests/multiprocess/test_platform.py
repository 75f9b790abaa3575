"""The CPU emulation layer: one test per redirected CUDA call (all run in one fresh process)."""

import json
import subprocess
import sys
import textwrap

import pytest

CHECKS = {
    "factory_device": "assert torch.zeros(2, device='cuda').device.type == 'cpu'",
    "factory_device_obj": "assert torch.empty(3, device=torch.device('cuda', 0)).device.type == 'cpu'",
    "tensor_cuda": "t = torch.ones(2); assert t.cuda() is t",
    "tensor_to_str": "assert torch.ones(2).to('cuda').device.type == 'cpu'",
    "tensor_to_int": "assert torch.ones(2).to(0).device.type == 'cpu'",
    "tensor_to_dtype_kept": "assert torch.ones(2).to('cuda', torch.float16).dtype == torch.float16",
    "tensor_to_kwarg": "assert torch.ones(2).to(device='cuda:1').device.type == 'cpu'",
    "current_device": "assert torch.cuda.current_device() == 0",
    "synchronize": "torch.cuda.synchronize()",
    "stream": "s = torch.cuda.current_stream(); s.synchronize()\nwith torch.cuda.stream(s): pass",
    "stream_class_in_annotations": "t = torch.cuda.Stream | None; torch.cuda.Stream().synchronize()\n"
                                   "from transformers import Qwen3ForCausalLM",
    "rng_state_is_cpu_state": textwrap.dedent("""
        st = torch.cuda.get_rng_state(); a = torch.rand(3)
        torch.cuda.set_rng_state(st); assert torch.equal(a, torch.rand(3))"""),
    "cuda_manual_seed": textwrap.dedent("""
        torch.cuda.manual_seed(5); a = torch.rand(2); torch.manual_seed(5)
        assert torch.equal(a, torch.rand(2))"""),
    "megatron_rng_tracker": textwrap.dedent("""
        from megatron.core.tensor_parallel import random as mr
        mr.get_cuda_rng_tracker().reset(); mr.get_cuda_rng_tracker().add('x', 3)
        base = torch.get_rng_state()
        with mr.get_cuda_rng_tracker().fork('x'): a = torch.rand(2)
        assert torch.equal(base, torch.get_rng_state())   # forking leaves the default stream alone
        mr.get_cuda_rng_tracker().reset(); mr.get_cuda_rng_tracker().add('x', 3)
        with mr.get_cuda_rng_tracker().fork('x'): b = torch.rand(2)
        assert torch.equal(a, b)"""),
    "tensor_type_reports_cuda": textwrap.dedent("""
        assert torch.ones(1).type() == 'torch.cuda.FloatTensor'
        assert torch.ones(1, dtype=torch.bfloat16).type() == 'torch.cuda.BFloat16Tensor'
        assert torch.ones(1).type(torch.float64).dtype == torch.float64"""),
    # megatron's fusions stay eager functions, and inductor is never imported (it costs ~1.4 s
    # of CPU a process): megatron_klear/__init__.py turns megatron's jit fuser off without CUDA
    "megatron_jit_fuser_off": textwrap.dedent("""
        import sys
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_swiglu
        assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
        assert type(fused_bias_swiglu.swiglu).__name__ == 'function'
        assert 'torch._inductor.lowering' not in sys.modules"""),
    "idempotent": "from megatron_klear import platform as p2; assert p2.setup() is plat",
    "backend_is_gloo": "assert plat.backend == 'gloo' and plat.emulated and str(plat.device) == 'cpu'",
}


RUNNER = textwrap.dedent("""
    import json, sys, traceback
    import torch
    from megatron_klear import platform
    plat = platform.setup()
    failed = {}
    for name, code in json.loads(sys.argv[1]).items():
        try:
            exec(code, {"torch": torch, "platform": platform, "plat": plat})
        except BaseException:
            failed[name] = traceback.format_exc()[-2000:]
    print(json.dumps(failed))""")


@pytest.fixture(scope="module")
def redirected() -> dict[str, str]:
    """Every check of CHECKS in one fresh process after ``platform.setup()`` (one interpreter
    start, not one per check): the failed ones' tracebacks by name."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(CHECKS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_redirected_call(redirected, name):
    assert name not in redirected, redirected.get(name)


def test_without_setup_cuda_is_not_redirected():
    """Negative control: the redirection exists only after setup()."""
    code = "import torch\ntry:\n    torch.zeros(1, device='cuda')\nexcept Exception:\n    raise SystemExit(3)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 3


STRICT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from megatron_klear import platform, virtual_cuda
    plat = platform.setup()
    assert plat.device.type == 'cuda' and plat.emulated
    a, b = torch.ones(3, device='cuda'), torch.ones(3)
    assert a.device.type == 'cuda' and a.is_cuda and b.device.type == 'cpu'
    assert (a + 1).device.type == 'cuda' and (a * torch.tensor(2.0)).is_cuda  # CPU scalars mix
    c = b.to(plat.device)                       # a move copies: the source stays on the CPU
    assert c.is_cuda and not b.is_cuda and (a + c).is_cuda and c.cpu().device.type == 'cpu'
    assert torch.arange(3, device=a.device).is_cuda
    w = torch.nn.Linear(3, 2).cuda(); x = torch.randn(4, 3, device='cuda', requires_grad=True)
    w(x).sum().backward(); assert w.weight.grad.is_cuda and x.grad.is_cuda   # backward too
    def raises(fn):
        try: fn()
        except virtual_cuda.DeviceMismatchError: return True
        return False
    assert raises(lambda: a + b) and raises(lambda: torch.nn.Linear(3, 2)(x))
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('tests.dist').dist.free_port()))
    dist.init_process_group('gloo', rank=0, world_size=1)
    dist.all_reduce(a)
    assert raises(lambda: dist.all_reduce(b))   # NCCL only moves CUDA tensors
    held = [None]; dist.all_gather_object(held, {'x': 1})  # torch picks that device itself
""")


def test_strict_device_mode_tags_and_raises_like_cuda_torch():
    """KLEAR_STRICT_DEVICES=1: tensors bound for the GPU report cuda; mixing raises."""
    import os

    env = {**os.environ, "KLEAR_STRICT_DEVICES": "1"}
    proc = subprocess.run([sys.executable, "-c", STRICT], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
