"""torch.distributed helpers: who am I, and switching gradient synchronisation per micro-batch.

Data parallelism averages gradients over ranks: DDP's all-reduce and FSDP2's reduce-scatter both
divide the sum by the world size W. The Accumulator undoes that factor and divides by the global
item count instead, so the window gradient is sum over ranks and micro-batches of
items * grad(loss) / global_items: the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

ParallelKind = Literal["ddp", "fsdp"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def is_rank_zero() -> bool:
    return rank() == 0


def data_parallel_kind(model: nn.Module) -> ParallelKind | None:
    """ "ddp" for DistributedDataParallel, "fsdp" for a model sharded with FSDP2's fully_shard, else None."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch builds without FSDP2
        return None
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp"
    return None


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Synchronise gradients across ranks in this block's backward only when ``enabled``.

    DDP: ``no_sync()`` while disabled (the forward must run inside it too, which is why the
    Accumulator yields each micro-batch from inside this context). FSDP2: the persistent
    ``set_requires_gradient_sync`` flag is switched off for the block and always set back to True
    on exit, also when an exception leaves the block, so a window never ends with sync off.
    """
    kind = data_parallel_kind(model)
    if enabled or kind is None:
        yield
        return
    if kind == "ddp":
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_values(values: Sequence[float], *, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over all ranks in one float64 all_reduce; identity when not distributed."""
    if not is_initialized() or world_size() == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]
