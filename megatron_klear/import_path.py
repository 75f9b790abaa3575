"""Functions named by import path (``package.module:function``), as flags name user code:
``--reward pkg.mod:fn``, ``--rollout-stages filter=pkg.mod:fn``."""

from __future__ import annotations

import importlib
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
