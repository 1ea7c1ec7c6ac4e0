"""An optimizer's class and hyperparameters without its state, and what its state will weigh.

The planner runs optimizer steps of its own (to measure, and in the trial). It must never step the
user's optimizer: ``fresh_optimizer_like`` builds one of the same class with the same parameter
groups and hyperparameters and empty state (a deepcopy that maps each parameter to itself, or to
a stand-in, and the state to an empty dict; torch's Optimizer.__setstate__ restores the hooks
machinery, and no state tensor is copied).

``optimizer_state_bytes`` counts the per-parameter state an optimizer creates in its first step
without allocating it: the same optimizer over meta-device stand-ins of the parameters, one step
on meta zero gradients, then the bytes of the meta tensors in its state. When an optimizer cannot
step on the meta device, a known per-parameter factor (state bytes = factor x parameter bytes) is
used, and for an unknown one the count is a lower bound (0).
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)

# State bytes per parameter byte after one step (torch.optim's implementations; amsgrad adds one).
KNOWN_FACTORS: Mapping[str, float] = {
    "Adam": 2.0,
    "AdamW": 2.0,
    "NAdam": 2.0,
    "RAdam": 2.0,
    "Adamax": 2.0,
    "Adadelta": 2.0,
    "Adagrad": 1.0,
    "RMSprop": 1.0,
    "Rprop": 2.0,
    "ASGD": 1.0,
}


def fresh_optimizer_like(
    optimizer: torch.optim.Optimizer, parameters: Mapping[int, torch.Tensor] | None = None
) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyperparameters, with the state a new one has.

    ``parameters`` maps id(original parameter) -> the tensor the new one steps instead (default:
    the same parameters). Built by the class's constructor from the parameter groups (each group
    carries every hyperparameter), so state that a constructor creates (Adagrad's sums) is there;
    a class whose constructor does not take parameter groups is deep-copied without its state.
    """

    def mapped(p: torch.Tensor) -> torch.Tensor:
        return parameters[id(p)] if parameters is not None else p

    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [mapped(p) for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    try:
        return type(optimizer)(groups)  # type: ignore[call-arg]
    except TypeError:
        pass
    memo: dict[int, object] = {id(p): mapped(p) for group in optimizer.param_groups for p in group["params"]}
    memo[id(optimizer.state)] = defaultdict(dict)
    return copy.deepcopy(optimizer, memo)


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """Bytes of the state ``optimizer`` creates for ``model``'s parameters; True when counted exactly.

    The optimizer is not stepped and nothing is allocated on the model's device.
    """
    stand_ins = {
        id(p): torch.empty_like(p, device="meta") for group in optimizer.param_groups for p in group["params"]
    }
    try:
        dry = fresh_optimizer_like(optimizer, stand_ins)
        for group in dry.param_groups:
            if group.get("fused"):
                group["fused"] = False  # fused kernels exist for real devices only
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        dry.step()
        total = 0
        for state in dry.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    total += value.numel() * value.element_size()
        return total, True
    except Exception as error:  # any optimizer may refuse meta tensors: fall back to its factor
        logger.debug("optimizer %s cannot step on the meta device (%s)", type(optimizer).__name__, error)
    factor = KNOWN_FACTORS.get(type(optimizer).__name__)
    parameter_bytes = sum(
        p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"]
    )
    if type(optimizer).__name__ == "SGD":
        momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
        return (parameter_bytes if momentum else 0), True
    if factor is None:
        return 0, False
    return int(factor * parameter_bytes), True
