"""A pipeline stage's gradients after the window: summed over replicas and tied copies, one global norm.

Each micro-batch's loss was already scaled by items_i / global_items (global over micro-batches,
pipeline steps and replicas), so every rank's gradient is its share of the gradient of the global
mean loss, and the shares only need adding:

- over data-parallel replicas: an all-reduce SUM on the stage's group (not DDP's average);
- over tied copies: torch's tracer gives each stage that uses a tied weight (a GPT's token embedding
  and output head) its own copy, so the copies' gradients are summed over every rank that holds one
  (all replicas together) and every copy steps the same way;
- the clipping norm is the norm of the whole model's gradient: squared norms summed over the
  stages of one replica (each tied weight counted once), then clip_grad_norm_'s coefficient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch.nn.utils.clip_grad_norm_'s epsilon: coef = max_norm / (total_norm + 1e-6), at most 1.
CLIP_EPSILON = 1e-6


@dataclass
class TiedSet:
    """One weight that several stages hold a copy of: the copies on this rank, the group of every
    rank that holds one (None when this rank is the only one), and whether this rank counts it in
    the gradient norm (the first holder stage does)."""

    names: frozenset[str]
    local: list[nn.Parameter] = field(default_factory=list)
    group: Any = None
    counts_in_norm: bool = False


def used_parameter_names(stage_module: nn.Module) -> set[str]:
    """Names of the stage module's parameters its graph uses (a traced stage keeps copies of tied
    weights it never calls, e.g. the output head's weight on the first stage)."""
    graph = getattr(stage_module, "graph", None)
    names = {name for name, _ in stage_module.named_parameters(remove_duplicate=False)}
    if graph is None:
        return names
    targets = [str(node.target) for node in graph.nodes if node.op in ("call_module", "get_attr")]
    return {name for name in names if any(name == t or name.startswith(t + ".") for t in targets)}


def alias_sets(model: nn.Module) -> list[frozenset[str]]:
    """The names under which each tied parameter of ``model`` appears, for those with two or more."""
    by_id: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(parameter), []).append(name)
    return [frozenset(names) for names in by_id.values() if len(names) > 1]


def tied_sets(
    model: nn.Module,
    stage_modules: Sequence[nn.Module],
    local_stages: Sequence[int],
    rank_of_stage: Any,
    num_replicas: int,
    num_stages_per_replica: int,
) -> list[TiedSet]:
    """Tied weights used by more than one stage, with this rank's copies and their process group.

    ``stage_modules`` holds every stage's module (each rank traced the whole model), so every rank
    computes the same sets in the same order and creates the same groups (new_group is a collective).
    """
    used = [used_parameter_names(module) for module in stage_modules]
    result = []
    for names in alias_sets(model):
        holders = [stage for stage, stage_used in enumerate(used) if names & stage_used]
        if len(holders) < 2:
            continue
        tied = TiedSet(names=names)
        ranks = sorted(
            {
                replica * num_stages_per_replica + rank_of_stage(stage)
                for stage in holders
                for replica in range(num_replicas)
            }
        )
        if len(ranks) > 1:
            tied.group = dist.new_group(ranks)
        for stage in local_stages:
            if stage in holders:
                params = dict(stage_modules[stage].named_parameters(remove_duplicate=False))
                tied.local.append(params[sorted(names & used[stage])[0]])
        tied.counts_in_norm = holders[0] in local_stages
        result.append(tied)
    return result


def reduce_gradients_(parameters: Sequence[nn.Parameter], tied: Sequence[TiedSet], stage_group: Any) -> None:
    """Sum gradients over replicas (``stage_group``) and tied weights over their holders, in place."""
    tied_ids = {id(p) for t in tied for p in t.local}
    plain = [p for p in parameters if p.grad is not None and id(p) not in tied_ids]
    if stage_group is not None and plain:
        # One flat buffer, one all-reduce (the stage's parameters, in a fixed order on every replica).
        flat = torch.cat([p.grad.reshape(-1) for p in plain])  # type: ignore[union-attr]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=stage_group)
        offset = 0
        for p in plain:
            count = p.numel()
            p.grad.copy_(flat[offset : offset + count].view_as(p))  # type: ignore[union-attr]
            offset += count
    for t in tied:
        grads = [p.grad for p in t.local if p.grad is not None]
        if not grads:
            continue
        total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
        if t.group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=t.group)
        for p in t.local:
            p.grad = total.clone()


def global_grad_norm(parameters: Sequence[nn.Parameter], tied: Sequence[TiedSet], pipe_group: Any) -> float:
    """The 2-norm of the whole model's gradient, on every rank of one replica (after reduction)."""
    tied_ids = {id(p) for t in tied for p in t.local}
    squares = [
        p.grad.double().pow(2).sum() for p in parameters if p.grad is not None and id(p) not in tied_ids
    ]
    squares += [
        t.local[0].grad.double().pow(2).sum()
        for t in tied
        if t.counts_in_norm and t.local[0].grad is not None
    ]
    device = parameters[0].device if parameters else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if pipe_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pipe_group)
    return float(total.sqrt())


def clip_(parameters: Sequence[nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale every gradient by clip_grad_norm_'s coefficient min(1, max_norm / (norm + eps))."""
    coefficient = max_norm / (total_norm + CLIP_EPSILON)
    if coefficient < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(coefficient)
