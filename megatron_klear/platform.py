"""Device and backend choice, and the CPU emulation of megatron-core's CUDA calls.

megatron-core hard-codes ``device="cuda"``, ``torch.cuda.current_device()`` and CUDA RNG
state in many places. On a machine without CUDA, :func:`setup` installs a small emulation
layer so that the *real* megatron-core stack (GPTModel, schedules, DDP, optimizer,
dist_checkpointing) runs on CPU under gloo:

* a global ``TorchFunctionMode`` that maps device ``"cuda"`` to ``"cpu"`` in tensor
  factories, ``Tensor.to`` and ``Tensor.cuda``;
* ``torch.cuda.current_device`` / ``synchronize`` / stream stubs;
* CUDA RNG get/set/seed redirected to the CPU generator, which megatron's RNG tracker uses;
* no-argument ``Tensor.type()`` reporting a cuda type name (megatron's grad clipping asserts it);
* the mode re-entered in custom autograd ``Function.backward`` and tensor hooks, which autograd
  runs with an empty mode stack (megatron's activation recompute re-runs the forward there);
* fp32 matmuls of megatron's linear layers sent to oneDNN (:func:`cpu_matmul`; torch's MKL
  sgemm runs its AVX2 code on AMD CPUs), and freed host memory kept in the process
  (:func:`megatron_klear.heap.keep_freed_memory`);
* two MoE shims (:func:`_patch_megatron_moe`): the router GEMM without Transformer Engine,
  and the all-to-all token dispatcher's split sizes as numpy arrays, as on GPU; and the
  precision-aware optimizer's TE version check without TE (:func:`_patch_megatron_optimizer_config`,
  GPU machines without TE too).

* megatron's jit fuser off (:func:`megatron_jit_loaded`, called by the import hook in
  megatron_klear/__init__.py): its ``torch.compile`` wrappers import inductor, ~1.4 s of CPU a
  process, for fusions our configs switch off.

* pinned host memory emulated (``pin_memory()``, ``pin_memory=True``, ``is_pinned()``), which
  CUDA-less torch refuses.

The strict virtual-CUDA mode of the tests (``KLEAR_STRICT_DEVICES=1``) lives in
megatron_klear/virtual_cuda.py; :func:`setup` installs it when it is asked for.

This is the ONLY module that knows the trainer may run without CUDA; everything else is
written as if on GPU. :func:`setup` is idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_klear import virtual_cuda
from megatron_klear.heap import keep_freed_memory

__all__ = ["Platform", "setup", "cuda_available", "device", "backend", "batch_p2p_comm",
           "is_emulated", "host_only_section", "gpu_uuid", "gpu_index_of_uuid", "pinned_buffer",
           "pinned_bytes", "megatron_jit_loaded"]


_TORCH_CUDA_AVAILABLE = torch.cuda.is_available  # strict device mode replaces the attribute


def cuda_available() -> bool:
    """True when a real CUDA device can be used."""
    return _TORCH_CUDA_AVAILABLE()


def megatron_jit_loaded(jit) -> None:
    """Without CUDA, turn megatron's jit fuser off with its own switch (megatron/core/jit.py).

    megatron-core wraps its fused activations in ``torch.compile`` when they are imported,
    which imports inductor: ~1.4 s of CPU in every process. Our model configs switch every
    fusion off, so on CPU that import buys nothing. With CUDA the fuser stays as megatron sets
    it. Called by the import hook in megatron_klear/__init__.py."""
    if not cuda_available() and hasattr(jit, "disable_jit_fuser"):
        jit.disable_jit_fuser()


def device() -> torch.device:
    """The device the trainer computes on (cuda:LOCAL_RANK on GPU and in strict device mode,
    cpu otherwise)."""
    if cuda_available() or virtual_cuda.active():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _visible_gpus() -> list[int] | None:
    """The physical GPUs ``CUDA_VISIBLE_DEVICES`` lists, in this process's order (None: all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return None
    return [int(x) for x in visible.split(",")]


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU ``index``, as SGLang's ``_device_to_uuid`` names it in a
    tensor handle (sglang/srt/utils/patch_torch.py). In strict device mode (or any process
    without CUDA, e.g. an embedded server) the virtual GPU's: ``GPU-virtual-<physical index>``,
    the physical index found through ``CUDA_VISIBLE_DEVICES`` as CUDA maps it."""
    if cuda_available():
        return str(torch.cuda.get_device_properties(index).uuid)
    visible = _visible_gpus()
    if visible is not None and not 0 <= index < len(visible):
        raise RuntimeError(f"CUDA error: invalid device ordinal {index} (CUDA_VISIBLE_DEVICES="
                           f"{os.environ['CUDA_VISIBLE_DEVICES']})")
    return f"GPU-virtual-{visible[index] if visible is not None else index}"


def gpu_index_of_uuid(uuid: str) -> int:
    """This process's index of the GPU ``uuid``; raises as SGLang's
    ``_device_from_maybe_uuid`` does ("Invalid device_uuid=...") when this process does not
    see it (a handle of memory on another GPU)."""
    if cuda_available():
        count = torch.cuda.device_count()
    else:
        visible = _visible_gpus()
        count = len(visible) if visible is not None else int(uuid.rsplit("-", 1)[-1]) + 1
    for index in range(count):
        if gpu_uuid(index) == uuid:
            return index
    raise RuntimeError(f"Invalid device_uuid={uuid} (this process sees CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES')}): the handle is of memory on "
                       "a GPU this process cannot see")


def backend() -> str:
    """torch.distributed backend: nccl on CUDA, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"


def batch_p2p_comm() -> bool:
    """megatron's ``batch_p2p_comm`` for pipeline sends: batched on NCCL, single isend/irecv
    on gloo. Measured: with interleaved stages at PP2 (the previous and the next stage are
    the same rank), gloo's ``batch_isend_irecv`` delivered one micro-batch's tensor in
    place of another's (wrong losses from the third micro-batch on); unbatched ops are
    exact (tests/multiprocess/test_pipeline_layouts.py)."""
    return backend() == "nccl"


def _redirect(dev):
    """Map a device spec naming CUDA to the CPU; leave anything else unchanged."""
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str):
        return "cpu" if dev.split(":")[0] == "cuda" else dev
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"
    return dev


_TO = {torch.Tensor.to}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}  # to cpu_matmul
_CUDA_METHODS = {torch.Tensor.cuda}
_PIN = torch.Tensor.pin_memory
_IS_PINNED = torch.Tensor.is_pinned


class _PinnedStorages:
    """Emulated page-locked host memory: the storages made by ``pin_memory()`` or a factory
    with ``pin_memory=True`` (CUDA-less torch refuses both: "no pinned memory allocator"),
    and the exact ones of :func:`pinned_buffer`. The pinned bytes are counted as CUDA torch
    pins them: its caching host allocator (aten/src/ATen/core/CachingHostAllocator.h) rounds
    each allocation up to a power of two and keeps a freed block cached for a later one of
    the same size; a registered plain allocation pins exactly its bytes."""

    def __init__(self) -> None:
        self.pinned: dict[int, weakref.ref] = {}
        self.exact = self.cached = 0  # bytes: registered exact buffers; torch's host cache
        self.in_use: dict[int, int] = {}  # torch-pinned storage -> its rounded block
        self.free_blocks: dict[int, int] = {}  # rounded block size -> cached free blocks

    def is_pinned(self, t: torch.Tensor) -> bool:
        storage = virtual_cuda.storage_of(t)
        ref = self.pinned.get(id(storage)) if storage is not None else None
        return ref is not None and ref() is storage

    def _track(self, t: torch.Tensor, on_free) -> None:
        storage = virtual_cuda.storage_of(t)
        if storage is not None:
            key = id(storage)
            self.pinned[key] = weakref.ref(storage, lambda _, k=key: on_free(k))

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s storage pinned through torch's caching host allocator."""
        storage = virtual_cuda.storage_of(t)
        if storage is not None:
            block = 1 << max(storage.nbytes() - 1, 0).bit_length()
            if self.free_blocks.get(block):
                self.free_blocks[block] -= 1  # a cached block of that size is reused
            else:
                self.cached += block
            self.in_use[id(storage)] = block
            self._track(t, self._freed)
        return t

    def _freed(self, key: int) -> None:
        self.pinned.pop(key, None)
        block = self.in_use.pop(key, None)
        if block is not None:  # back to the cache: still pinned
            self.free_blocks[block] = self.free_blocks.get(block, 0) + 1

    def pin_exact(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s storage pinned as a registered plain allocation: exactly its bytes."""
        nbytes = t.untyped_storage().nbytes()
        self.exact += nbytes

        def freed(key: int, n: int = nbytes) -> None:
            self.pinned.pop(key, None)
            self.exact -= n

        self._track(t, freed)
        return t


_PINNED = _PinnedStorages()


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes`` pinned exactly: a plain allocation registered with
    CUDA (``cudaHostRegister``), not torch's caching host allocator, which rounds each
    allocation up to a power of two and keeps it (up to 2x the bytes asked for). Pinned for
    the buffer's life (unregistered by a finalizer of its storage's Python object, which
    torch deallocates with the storage; unverified on a GPU). Without CUDA: plain host
    memory (pinned by the emulation in strict device mode). CUDA branch not run on a GPU."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    if cuda_available():
        if nbytes:
            cudart, ptr = torch.cuda.cudart(), buf.data_ptr()
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
            weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, ptr)
        return buf
    return _PINNED.pin_exact(buf) if virtual_cuda.active() else buf


def pinned_bytes() -> int:
    """Strict mode: host bytes pinned now, as CUDA torch would hold them (exact buffers of
    :func:`pinned_buffer`, plus torch's host cache: every power-of-two block it made)."""
    return _PINNED.exact + _PINNED.cached
class _CudaToCpuMode(TorchFunctionMode):
    """Redirects every tensor creation or move that names CUDA to the CPU (and, in strict
    device mode, tags the results as CUDA and answers device queries for tagged tensors)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS and not kwargs:
            out = cpu_matmul(*args)
            if out is not None:
                return out
        kwargs = dict(kwargs or {})
        if self.strict and func in virtual_cuda.DEVICE_QUERIES:
            return virtual_cuda.DEVICE_QUERIES[func](args[0])
        if func is _IS_PINNED:
            return _PINNED.is_pinned(args[0])
        if func is _PIN:  # a pinned copy (the tensor itself when it is pinned already)
            if _PINNED.is_pinned(args[0]):
                return args[0]
            return _PINNED.pin(args[0].clone())
        pinned = bool(kwargs.pop("pin_memory", False))
        target = virtual_cuda.target_device(func, args, kwargs) if self.strict else None
        if func in _CUDA_METHODS:
            out = args[0]
        else:
            if "device" in kwargs:
                kwargs["device"] = _redirect(kwargs["device"])
            if func in _TO:
                args = tuple(_redirect(a) if isinstance(a, (str, torch.device)) else a
                             for a in args)
                if len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool):
                    args = (args[0], "cpu") + args[2:]
            out = func(*args, **kwargs)
        if target is not None:
            out = virtual_cuda.tag_result(func, args, out, target)
        return _PINNED.pin(out) if pinned else out


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            return _CUDA_TYPE_NAMES.get(self.dtype, original(self))
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _patch_cuda_module() -> None:
    """Stubs for the torch.cuda calls megatron-core makes outside tensor creation."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.ipc_collect = lambda: None  # nothing shared by handle (strict mode: its own limbo)
    # no device memory (strict device mode counts the virtual GPU's: virtual_cuda.install)
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.mem_get_info = lambda *a, **k: (0, 0)
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream  # a class: annotations like `torch.cuda.Stream | None` work
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.Event = _NullEvent
    # RNG: megatron's tracker keeps "CUDA" generator states; the CPU generator stands in.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )


def _patch_megatron_moe(emulated: bool) -> None:
    """Shims for megatron-core 0.16.1's MoE layer where it assumes TE or CUDA tensors.

    * ``megatron/core/transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only when
      Transformer Engine imports, yet ``router_gating_linear`` tests ``te_general_gemm is not
      None`` unconditionally: without TE (GPU or CPU) that is a NameError. Defining it as None
      selects megatron's own ``torch.matmul`` path.
    * ``megatron/core/transformer/moe/token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher.
      _maybe_dtoh_and_synchronize``) turns the split sizes into numpy arrays only when they
      are CUDA tensors (``moe_utils.maybe_move_tensor_to_cpu``); on the CPU they would stay
      tensors, and torch's ``all_to_all_single`` rejects tensor split sizes ("incompatible
      function arguments"). The emulation converts CPU tensors too, so the dispatcher sees
      what it sees on a GPU; it never records a stream (``Tensor.record_stream`` needs a
      real CUDA stream, and the emulated streams differ from each other, so the dispatcher
      would ask for it in strict device mode).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not emulated:
        return
    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = original(tensor, as_numpy=as_numpy, record_stream=False)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _patch_megatron_optimizer_config() -> None:
    """megatron/core/optimizer/optimizer_config.py (0.16.1) asks ``is_te_min_version("2.1.0")``
    whenever ``use_precision_aware_optimizer`` is on, and without Transformer Engine that
    compares None with a version (TypeError), although the CPU-offloading optimizer, which
    Megatron-LM requires that flag with, needs no TE. Without TE the answer is False."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config

    if utils.get_te_version() is None:
        optimizer_config.is_te_min_version = lambda *args, **kwargs: False


class _NullStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def wait_stream(self, other) -> None:  # noqa: D102
        pass

    def wait_event(self, event) -> None:  # noqa: D102
        pass

    def record_event(self, event=None):  # noqa: D102
        return _NullEvent()


class _NullEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:  # noqa: D102
        pass

    def synchronize(self) -> None:  # noqa: D102
        pass

    def wait(self, stream=None) -> None:  # noqa: D102
        pass

    def query(self) -> bool:  # noqa: D102
        return True

    def elapsed_time(self, other) -> float:  # noqa: D102
        return 0.0


def _keep_mode_in_backward(mode: TorchFunctionMode) -> None:
    """Re-enter ``mode`` in Python code that autograd runs during backward.

    The autograd engine runs custom ``Function.backward`` methods and tensor hooks with an
    empty torch-function-mode stack, so without this megatron's recompute (which re-runs the
    forward inside backward) would create real CUDA tensors and fail.
    """
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    def entered(fn):
        def run(*args, **kwargs):
            if mode in _get_current_function_mode_stack():
                return fn(*args, **kwargs)
            with mode:
                return fn(*args, **kwargs)
        return run

    backward_apply = BackwardCFunction.apply
    BackwardCFunction.apply = lambda self, *args: entered(backward_apply)(self, *args)
    register_hook = torch.Tensor.register_hook
    torch.Tensor.register_hook = lambda self, hook: register_hook(self, entered(hook))


# --------------------------------------------------------------------------- CPU GEMM

CPU_GEMM_ENV = "KLEAR_CPU_GEMM"
CPU_GEMMS = ("onednn", "mkl")
# Below this many multiply-adds MKL's sgemm is as fast as oneDNN's, whose fixed cost per call
# is larger (benchmarks/bench_cpu_gemm.py: 64 x 128 x 256 gains, 64 x 128 x 128 does not).
MIN_ONEDNN_MACS = 1 << 21


def cpu_gemm_choice() -> str:
    """``KLEAR_CPU_GEMM``: ``onednn`` (the default) or ``mkl`` (torch's sgemm); another value
    raises ConfigError, which the trainers' preflight turns into exit 2 before anything is
    built, in ``--dry-run`` as in the run."""
    choice = os.environ.get(CPU_GEMM_ENV) or "onednn"
    if choice not in CPU_GEMMS:
        from megatron_klear.config import ConfigError

        raise ConfigError(f"{CPU_GEMM_ENV}={choice!r} names no CPU GEMM: use one of "
                          f"{', '.join(CPU_GEMMS)} or unset it")
    return choice


@functools.cache
def _onednn_mm():
    """``torch.ops.klear.onednn_mm`` where the extension has it, this CPU runs it (ATen's
    oneDNN fp32 matmul wants AVX-512 or AVX-NE-CONVERT) and :func:`cpu_gemm_choice` allows
    it; else None."""
    if cpu_gemm_choice() == "mkl":
        return None
    try:
        from megatron_klear import _C
    except ImportError:
        return None
    if not getattr(_C, "onednn_gemm", False):
        return None
    try:
        torch.ops.klear.onednn_mm(torch.ones(1, 1), torch.ones(1, 1))
    except RuntimeError:  # e.g. "mkldnn_matmul bf16 path needs the cpu support avx512bw..."
        return None
    return torch.ops.klear.onednn_mm


@functools.cache
def onednn_linear():
    """``linear(x, weight, bias)`` (``F.linear``'s contract, fp32 CPU tensors) through torch's
    oneDNN linear, ``torch.ops.mkldnn._linear_pointwise`` (the op torch's inductor calls for
    CPU linears), where this torch has it, it computes right here and :func:`cpu_gemm_choice`
    allows oneDNN; else None. The embedded server's decode steps run their projections
    through it: a 64-row step's 128 -> 512 projection takes about 45 us where MKL's sgemm
    takes about 80 on this AMD CPU (benchmarks/bench_cpu_gemm.py). oneDNN builds a kernel per
    shape (about 0.4 ms, then cached), so callers keep their shapes few."""
    if cpu_gemm_choice() == "mkl":
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.arange(32.0).view(4, 8), torch.ones(3, 8)
        if not torch.equal(op(x, w, None, "none", [], ""), x.sum(1, keepdim=True).expand(4, 3)):
            return None
    except (AttributeError, RuntimeError):  # a torch without it, or without oneDNN
        return None
    return lambda x, weight, bias=None: op(x, weight, bias, "none", [], "")


def cpu_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` through oneDNN for fp32 CPU operands ``a`` [..., m, k] and ``b`` [k, n] of at
    least MIN_ONEDNN_MACS multiply-adds, outside autograd; None where that does not apply
    (the caller runs torch's matmul). torch's fp32 matmul is MKL's sgemm, which runs its AVX2
    code on AMD CPUs with AVX-512 at half of oneDNN's speed there (csrc/cpu/onednn_gemm.h)."""
    if (not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or b.dim() != 2
            or a.dim() < 2 or a.dtype != torch.float32 or b.dtype != torch.float32
            or a.device.type != "cpu" or b.device.type != "cpu"
            or a.numel() * b.shape[1] < MIN_ONEDNN_MACS or a.shape[-1] == 0):
        return None
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    mm = _onednn_mm()
    if mm is None:
        return None
    return mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[1])


@dataclass(frozen=True)
class Platform:
    """What :func:`setup` chose."""

    device: torch.device
    backend: str
    emulated: bool


_STATE: dict = {}


def setup() -> Platform:
    """Choose device/backend and, without CUDA, install the CPU emulation once."""
    if "platform" in _STATE:
        return _STATE["platform"]
    emulated = not cuda_available()
    if emulated:
        _onednn_mm()  # a bad KLEAR_CPU_GEMM fails here, before anything is built
        keep_freed_memory()
        # megatron's RNG tracker warns whenever its "CUDA" generator, here the CPU one, moves
        logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
        _patch_cuda_module()
        _patch_megatron_rng()
        _patch_tensor_type()
        strict = virtual_cuda.active()
        if strict:
            _STATE["check"] = virtual_cuda.install()
        mode = _CudaToCpuMode(strict)
        mode.__enter__()  # global for the process: megatron creates tensors everywhere
        _keep_mode_in_backward(mode)
        _STATE["mode"] = mode
    else:
        torch.cuda.set_device(device())
    _patch_megatron_moe(emulated)
    _patch_megatron_optimizer_config()
    _STATE["platform"] = Platform(device=device(), backend=backend(), emulated=emulated)
    return _STATE["platform"]


@contextlib.contextmanager
def host_only_section() -> Iterator[None]:
    """A section that touches host tensors only and names no device (e.g. writing a
    checkpoint file): the CPU emulation's cuda -> cpu ``TorchFunctionMode`` is lifted
    there, since it has nothing to redirect and its per-op Python hook cost ~0.2 s of CPU
    per Qwen3-0.6B conversion. No-op on GPU machines, in strict device mode (whose
    tensors must stay tagged) and where another mode is on top."""
    mode = _STATE.get("mode")
    if mode is None or mode.strict or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def is_emulated() -> bool:
    """True once :func:`setup` installed the CPU emulation."""
    return "platform" in _STATE and _STATE["platform"].emulated
