"""MoE routing replay (R3): the trainer's routers use the experts the rollout engine chose.

RL on MoE models drifts when the rollout engine and the trainer route a token to different
experts: the log-prob ratio then compares two different sub-networks. SGLang returns the
top-k expert ids of every forwarded token and MoE layer (``return_routed_experts``); a
micro-batch carries them as ``routed_experts`` [b, s, layers, k] aligned with its tokens, and
megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``,
megatron/core/transformer/moe/router_replay.py) makes each router take them instead of its
own top-k, keeping its own scores for the chosen experts (so gradients still reach the
router weights).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["replay_routing", "routers"]

_ROUTERS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of ``model`` (a model chunk) that can replay, in layer order."""
    if model not in _ROUTERS:
        _ROUTERS[model] = [m for m in model.modules()
                           if getattr(m, "router_replay", None) is not None]
    return _ROUTERS[model]


def replay_routing(model: torch.nn.Module, experts: Tensor | None) -> None:
    """Make ``model``'s routers replay ``experts`` ([b, s, layers, k] in the micro-batch's
    token layout, all of the model's layers), or route by their own top-k (None)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = routers(model)
    if experts is not None and not found:
        raise ValueError("the micro-batch carries routed_experts but the model's routers "
                         "cannot replay: build it with --use-routing-replay")
    # megatron runs [s, b] (THD: b = 1): the router sees tokens s-major
    tokens = None if experts is None else experts.transpose(0, 1).reshape(
        -1, *experts.shape[2:])
    for router in found:
        replay = router.router_replay
        if tokens is None:
            replay.clear_router_replay_action()
            replay.target_topk_idx = None
        else:
            replay.target_topk_idx = tokens[:, router.layer_number - 1].long()
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
