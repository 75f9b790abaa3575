"""Functions named by import path (``package.module:function``), as flags name user code:
``--reward pkg.mod:fn``, ``--rollout-stages filter=pkg.mod:fn``."""

from __future__ import annotations

import importlib
import threading
from typing import Callable


def load_callable(path: str, what: str) -> Callable:
    """The callable at ``path`` ('package.module:function'); ``what`` (e.g. "reward") names it
    in the ValueError raised for a malformed path, a missing module or attribute, or an
    attribute that is not callable."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} import path {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {what} {path!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"{what} {path!r} is not callable")
    return fn


class Registry:
    """Named callables of one kind (rewards, rollout stages, tool-call parsers): built-ins,
    user registrations, and import paths loaded on first use, so that a flag can name any
    of them the same way."""

    def __init__(self, what: str, builtins: dict[str, Callable | str]) -> None:
        """``builtins``: name -> callable, or -> an import path loaded when first asked for
        (keeps heavy modules out of start-up)."""
        self.what = what
        self._paths = {n: v for n, v in builtins.items() if isinstance(v, str)}
        self._fns = {n: v for n, v in builtins.items() if not isinstance(v, str)}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The names known without an import path."""
        with self._lock:
            return sorted(set(self._fns) | set(self._paths))

    def register(self, name: str, fn: Callable) -> None:
        """Make ``fn`` available as ``name`` (replaces an earlier registration)."""
        if not callable(fn):
            raise TypeError(f"{self.what} {name!r} must be callable, got {type(fn).__name__}")
        with self._lock:
            self._fns[name] = fn

    def get(self, name: str) -> Callable:
        """The callable registered as ``name``, a built-in, or at the import path
        'pkg.module:function'; ValueError names an unknown one."""
        with self._lock:
            if name in self._fns:
                return self._fns[name]
        if name in self._paths or ":" in name:
            fn = load_callable(self._paths.get(name, name), self.what)
            self.register(name, fn)
            return fn
        raise ValueError(f"unknown {self.what} {name!r}: use one of {self.names()} or an "
                         "import path 'package.module:function'")
