"""Build megatron-klear and its C++/CUDA extension.

The CPU extension (C++/OpenMP) is always built. CUDA sources join the build only when a
CUDA build of torch and nvcc are both present. torch must already be installed, so
install with ``pip install --no-build-isolation -e .`` (see README).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - reported to the user
    sys.exit("megatron-klear: install torch first (pip install torch==2.13.0), then "
             "pip install --no-build-isolation -e .")


def _nvcc_gencode() -> list[str]:
    """sm_80 + sm_90 machine code and compute_90 PTX (JIT-compiled by drivers of newer GPUs);
    the one list, shared with tools/nvcc_compile_check.sh."""
    with open(os.path.join("csrc", "cuda", "nvcc_gencode.txt")) as f:
        return f.read().split()


def _extensions():
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not cpp:
        return []
    use_cuda = torch.version.cuda is not None and CUDA_HOME is not None and \
        os.environ.get("KLEAR_NO_CUDA", "0") != "1"
    cxx = ["-O3", "-std=c++20", "-fopenmp"]
    if use_cuda:
        cu = sorted(glob.glob("csrc/**/*.cu", recursive=True))
        return [CUDAExtension(
            "megatron_klear._C", cpp + cu,
            extra_compile_args={"cxx": cxx + ["-DKLEAR_WITH_CUDA"],
                                "nvcc": ["-O3", "-std=c++17", "-DKLEAR_WITH_CUDA",
                                         *_nvcc_gencode()]},
            extra_link_args=["-fopenmp"], include_dirs=[os.path.abspath("csrc")])]
    return [CppExtension("megatron_klear._C", cpp, extra_compile_args=cxx,
                         extra_link_args=["-fopenmp"], include_dirs=[os.path.abspath("csrc")])]


setup(
    name="megatron-klear",
    version="0.1.0",
    description="RL post-training for reasoning LLMs on megatron-core (Klear-Reasoner recipe, GPPO)",
    packages=find_packages(include=["megatron_klear", "megatron_klear.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",  # the tested release (a newer one resolves untested)
        "transformers>=4.51",
        "safetensors",
        "numpy",
        "pybind11",
        "ninja",
        "psutil",
        "math-verify>=0.7",
        "pyyaml",
        "tqdm",
        "aiohttp>=3.9",
        "tensorboard",
        "matplotlib",
        "pyarrow",
    ],
    extras_require={
        # one GPU environment, installed in the order of README.md's GPU install with
        # constraints-gpu.txt (sglang pins torch; TE and _C build against that torch)
        "gpu": ["transformer-engine[pytorch,core_cu13]==2.11.0", "sglang==0.5.23",
                "sglang-router==0.3.2", "torch-memory-saver==0.0.10"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": [
        "klear-sft=megatron_klear.train.sft:main",
        "klear-rl=megatron_klear.train.rl:main",
        "klear-eval=megatron_klear.eval.__main__:main",
    ]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
