"""``--loss-backend``: which implementation computes the fused vocab-parallel losses.

``auto`` never falls back silently: on a GPU it is the CUDA kernel (the torch reference keeps
fp32 softmax-sized copies, about 45 GB more at 32K tokens for Qwen3's vocabulary), on a CPU the
C++ kernel; when the extension lacks them the run stops and says how to build it or to ask
for ``--loss-backend torch`` explicitly.
"""

from __future__ import annotations

from megatron_klear import platform
from megatron_klear.config import ConfigError
from megatron_klear.ops.vocab_parallel import available_backends

__all__ = ["loss_backend"]


def loss_backend(requested: str) -> str:
    """The backend for ``--loss-backend requested`` on this process's compute device."""
    dev = platform.device()
    kind = dev.type
    wanted = kind if requested == "auto" else requested
    if wanted not in ("cuda", "cpu", "torch"):
        raise ConfigError(f"--loss-backend {requested!r}: choose from auto, cuda, cpu, torch")
    if wanted != "torch" and wanted != kind:
        raise ConfigError(f"--loss-backend {requested}: the trainer computes on {kind}; use "
                          f"--loss-backend auto or torch")
    if wanted not in available_backends(dev):
        raise ConfigError(
            f"--loss-backend {requested}: megatron_klear._C has no {wanted} kernel here (build it "
            "with `pip install --no-build-isolation -e .`"
            f"{' on a machine with CUDA torch and nvcc' if wanted == 'cuda' else ''}), or pass "
            "--loss-backend torch for the unfused reference (much more memory)")
    return wanted
