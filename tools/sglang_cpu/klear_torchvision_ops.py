"""Declare the ``torchvision::nms`` and ``torchvision::qnms`` op schemas before torchvision loads.

Stands in for the schema registrations of torchvision's compiled extension
(torchvision/csrc/ops/nms.cpp, loaded as torchvision/_C.so). The published torchvision 0.28.0
wheel is a CUDA build whose _C.so cannot load next to the CPU torch build, and then
torchvision/_meta_registrations.py fails registering fake kernels for ops that do not exist;
SGLang imports torchvision (through transformers' image utilities) and would not start.
Only the schemas are declared: calling the ops raises (no kernel), which nothing in a text
model's serving path does. Loaded from ``klear_torchvision_ops.pth`` by a meta-path hook
that runs just before the first ``import torchvision``, so other programs pay nothing.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = {"nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}


def declare() -> None:
    """Define the schemas (idempotent); keeps the library object alive on this module."""
    import torch

    global _LIB
    if "_LIB" in globals():
        return
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not torch._C._jit_get_schemas_for_operator(f"torchvision::{name}"):  # not yet declared
            _LIB.define(schema)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            declare()
        return None  # let the normal finders import torchvision


def install() -> None:
    """Arm the hook (called from the .pth file at interpreter start)."""
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
