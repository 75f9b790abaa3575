"""megatron-klear: RL post-training for reasoning LLMs on megatron-core (Klear-Reasoner recipe)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


class _AfterMegatronJit(importlib.abc.MetaPathFinder):
    """Hands ``megatron.core.jit`` to :func:`megatron_klear.platform.megatron_jit_loaded` as soon
    as it has run, before megatron's fusion modules decorate themselves with its ``jit_fuser``:
    the only moment that choice can still change. Torch-free, because the sandbox imports this
    package without torch."""

    def find_spec(self, name, path=None, target=None):  # noqa: D102
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                from megatron_klear.platform import megatron_jit_loaded
                megatron_jit_loaded(module)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterMegatronJit())
