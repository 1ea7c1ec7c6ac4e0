"""Gradient sync per micro-batch, differently for the two wrappers.

Data parallelism averages gradients over ranks: DDP's all-reduce and FSDP2's reduce-scatter both
divide the sum by the world size W. The Accumulator undoes that factor and divides by the global
item count instead, so the window gradient is sum over ranks and micro-batches of
items * grad(loss) / global_items: the gradient of the global batch's mean loss.

- DDP decides in the *forward* whether the coming backward all-reduces (``no_sync()`` must cover
  the forward too), so the whole micro-batch runs inside ``ddp_sync``.
- FSDP2 reads its persistent ``set_requires_gradient_sync`` flag only in the post-backward hook,
  so ``fsdp_sync`` switches it off for the backward alone and sets it back to True in a
  ``finally``: whatever happens, the flag is True outside a non-last micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Literal

from torch import nn

from ..trees.modules import unwrap_compiled

logger = logging.getLogger(__name__)

ParallelKind = Literal["ddp", "fsdp"]


# ---------------------------------------------------------------------- gradient sync


def data_parallel_kind(model: nn.Module) -> ParallelKind | None:
    """ "ddp" for DistributedDataParallel, "fsdp" for a model sharded with FSDP2's fully_shard, else None.

    A ``torch.compile``'d model is looked through: what it wraps decides.
    """
    model = unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch builds without FSDP2
        return None
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp"
    return None


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def ddp_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Run a DDP micro-batch (forward and backward) with or without its gradient all-reduce.

    Disabled: ``model.no_sync()``. Enabled: sync is forced on, in case an abandoned loop left a
    ``no_sync`` open (the gradient would silently stay local). A no-op for other models.
    """
    model = unwrap_compiled(model)  # torch.compile(DDP(model)): the DDP module holds the sync flag
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        yield
        return
    if enabled:
        model.require_backward_grad_sync = True
        yield
        return
    with model.no_sync():
        yield


@contextlib.contextmanager
def fsdp_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Run one backward with or without FSDP2's reduce-scatter; the flag is True again on exit,
    also when the backward raises. A no-op for other models."""
    modules = _fsdp_modules(model) if data_parallel_kind(model) == "fsdp" else []
    if not modules:
        yield
        return
    for module in modules:
        module.set_requires_gradient_sync(enabled, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]
