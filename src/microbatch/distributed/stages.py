"""Where a pipeline's pieces go: which rank runs which stage, and where the model is cut.

Ranks are laid out replica-major: rank r runs stage ``r % S`` of data-parallel replica ``r // S``,
so one replica's stages are neighbours (their point-to-point traffic stays on one machine when a
machine holds S ranks) and the ranks of one stage across replicas form its data-parallel group.

Cuts are made at the start of blocks (the repeated layers of the model: transformer blocks). A
stage holds a contiguous run of blocks; the first stage also holds what comes before the first block
(embeddings), the last what comes after the last one (final norm, head, loss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .process import is_initialized, rank, world_size


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in a DP x PP layout, and the process groups it talks on.

    ``pipe_group`` holds the S ranks of this rank's replica (the schedule's point-to-point
    sends), ``stage_group`` the R ranks that run this rank's stage (the data-parallel gradient
    all-reduce). Groups are None when they would hold this rank alone.
    """

    num_stages: int
    num_replicas: int
    stage_index: int
    replica_index: int
    pipe_group: Any
    stage_group: Any

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def pipeline_layout(num_stages: int) -> PipelineLayout:
    """The layout of ``num_stages`` stages over the ranks of the default process group.

    Every rank must call it at the same point (it creates process groups, a collective).
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"pipeline stages must be a positive integer, got {num_stages!r}")
    world = world_size()
    if num_stages > 1 and not is_initialized():
        raise ConfigError(
            f"a pipeline of {num_stages} stages needs {num_stages} processes; launch with "
            f"`torchrun --nproc-per-node {num_stages}` (or a multiple of {num_stages} for data parallelism)"
        )
    if world % num_stages:
        raise ConfigError(
            f"world size {world} is not a multiple of the pipeline's {num_stages} stages; "
            f"launch a multiple of {num_stages} processes (each group of {num_stages} consecutive ranks "
            "is one data-parallel replica of the pipeline)"
        )
    replicas = world // num_stages
    me = rank()
    pipe_group = stage_group = None
    if world > 1:
        # new_group is a collective over the whole world: every rank creates every group, in order.
        for replica in range(replicas):
            group = dist.new_group([replica * num_stages + s for s in range(num_stages)])
            if replica == me // num_stages:
                pipe_group = group
        for stage in range(num_stages):
            group = dist.new_group([replica * num_stages + stage for replica in range(replicas)])
            if stage == me % num_stages:
                stage_group = group
    return PipelineLayout(
        num_stages=num_stages,
        num_replicas=replicas,
        stage_index=me % num_stages,
        replica_index=me // num_stages,
        pipe_group=pipe_group if num_stages > 1 else None,
        stage_group=stage_group if replicas > 1 else None,
    )


# ---------------------------------------------------------------------- where to cut


def find_block_names(model: nn.Module) -> list[str]:
    """The names of the model's blocks: the children of its longest ModuleList (or Sequential).

    A transformer's layers (``blocks.0`` .. ``blocks.N-1``); ties go to the first in model order.
    """
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > len(best):
            best = [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    if not best:
        raise ConfigError(
            "found no blocks to cut the model at (no nn.ModuleList or nn.Sequential of layers); "
            "pass blocks=[...] with the names of the modules where stages 1..S-1 begin"
        )
    return best


TIE = 1e-9  # relative: stage costs closer than this are equal


def balanced_cuts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Indices of the blocks that begin stages 1 .. S-1, minimising the largest stage's cost.

    The classic linear partition: best[k][j] is the smallest possible maximum over k stages holding
    blocks 0 .. j-1, best[k][j] = min over i of max(best[k-1][i], sum(costs[i:j])). Exact, O(S n^2)
    for n blocks (n is tens, S is a handful). Ties (within a relative 1e-9: sums of equal layers'
    times differ in their last bits) go to the smallest i, the longest later stage: 80 equal layers
    in 8 stages with a heavier head put the 11-layer stage last but one, not first, where 1F1B holds
    the most micro-batches in flight (S - s on stage s) and the extra layer costs the most memory.
    """
    count = len(costs)
    if count < num_stages:
        raise ConfigError(
            f"the model has {count} block(s), fewer than the {num_stages} pipeline stages; "
            f"use at most {count} stages (every stage needs at least one block)"
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(num_stages + 1)]
    cut_at = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, count + 1):
            for i in range(k - 1, j):
                candidate = max(best[k - 1][i], prefix[j] - prefix[i])
                if candidate < best[k][j] * (1 - TIE):
                    best[k][j], cut_at[k][j] = candidate, i
    cuts, end = [], count
    for k in range(num_stages, 1, -1):
        end = cut_at[k][end]
        cuts.append(end)
    return sorted(cuts)


def stage_starts(
    model: nn.Module,
    num_stages: int,
    blocks: Sequence[str] | str = "auto",
    *,
    block_costs: Mapping[str, float] | None = None,
) -> list[str]:
    """The names of the blocks where stages 1 .. S-1 begin.

    ``blocks``: those names themselves (S - 1 of them, in model order), or "auto": cut the model's
    blocks (find_block_names) into S contiguous runs balanced by ``block_costs`` (seconds per block,
    e.g. from the profiler) or, without them, by parameter count.
    """
    if num_stages == 1:
        return []
    modules = dict(model.named_modules())
    if not isinstance(blocks, str):
        return _checked_starts(list(blocks), modules, num_stages)
    if blocks != "auto":
        raise ConfigError(f'blocks must be "auto" or a list of module names, got {blocks!r}')
    names = find_block_names(model)
    if block_costs is not None:
        missing = [name for name in names if name not in block_costs]
        if missing:
            raise ConfigError(f"block_costs has no cost for block(s) {', '.join(missing[:3])}")
        costs = [float(block_costs[name]) for name in names]
    else:
        costs = [float(sum(p.numel() for p in modules[name].parameters())) for name in names]
    return [names[index] for index in balanced_cuts(costs, num_stages)]


def _checked_starts(starts: list[str], modules: Mapping[str, nn.Module], num_stages: int) -> list[str]:
    if len(starts) != num_stages - 1:
        raise ConfigError(
            f"blocks names where stages 1..{num_stages - 1} begin: {num_stages - 1} name(s) for "
            f"{num_stages} stages, got {len(starts)} ({starts})"
        )
    unknown = [name for name in starts if name not in modules or not name]
    if unknown:
        raise ConfigError(f"blocks: no module named {', '.join(map(repr, unknown))} in the model")
    order = {name: index for index, name in enumerate(modules)}
    if [order[name] for name in starts] != sorted(order[name] for name in starts) or len(set(starts)) < len(
        starts
    ):
        raise ConfigError(f"blocks must be distinct and in model order, got {starts}")
    return starts
