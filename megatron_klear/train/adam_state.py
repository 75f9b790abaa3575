"""Workarounds for megatron-core 0.16.1's distributed optimizer over torch's Adam/AdamW.

Without Apex or Transformer Engine, megatron's ``DistributedOptimizer`` wraps a
``torch.optim.AdamW`` whose per-parameter state holds the Adam ``step``. Two resume bugs
follow (distrib_optimizer.py, ``state_dict`` / ``load_state_dict``):

* ``state_dict()`` asserts that all per-parameter steps agree, so it fails on an optimizer
  that has not stepped yet: a fresh optimizer cannot even be asked for the sharded state
  dict it must load into. :func:`init_adam_state` gives every parameter the state torch
  would create on its first step (zero moments, step 0), which changes no update.
* ``load_state_dict()`` puts ONE step tensor into every parameter's state; torch's AdamW
  increments each parameter's step in place, so after a resume the shared step advances
  once per parameter per iteration and the bias correction is silently wrong.
  :func:`untie_adam_steps` gives each parameter its own copy.
* loading the canonical (``fully_reshardable``) layout copies every key of a parameter's
  state from the checkpoint, ``step`` included, but the checkpoint carries the step in the
  param groups only: ``KeyError: 'step'``. :func:`init_adam_state` also makes that copy leave
  ``step`` alone.

The fused Adam of Apex/TE keeps the step in the param groups and is left alone.
"""

from __future__ import annotations

import torch

__all__ = ["init_adam_state", "untie_adam_steps"]


def _with_torch_adam(optimizer) -> list:
    """The megatron optimizers inside ``optimizer`` (chained or not) that wrap torch Adam."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for p in parts
            if isinstance(getattr(p, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    return [p.optimizer for p in _with_torch_adam(optimizer)]


def _keep_step_on_state_copy(dist_opt) -> None:
    """Make ``_set_main_param_and_optimizer_states`` skip a ``step`` the source lacks."""
    copy_states = dist_opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group, order = dist_opt.model_param_group_index_map[model_param]
        state = dist_opt.optimizer.state[dist_opt.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            copy_states(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    dist_opt._set_main_param_and_optimizer_states = set_states


def init_adam_state(optimizer) -> None:
    """Create each parameter's Adam state as torch's first step would (zeros, step 0), and
    let checkpoint loads keep it."""
    for part in _with_torch_adam(optimizer):
        if hasattr(part, "_set_main_param_and_optimizer_states"):
            _keep_step_on_state_copy(part)
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)


def untie_adam_steps(optimizer) -> None:
    """Give every parameter its own ``step`` tensor after a distributed-optimizer load."""
    for adam in _torch_adams(optimizer):
        for state in adam.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().clone()
