"""``ExactAccumulation``: Lightning's ``accumulate_grad_batches`` with the full window's gradient.

Lightning's automatic optimization backpropagates ``loss_m / k`` for each of a window's k
micro-batches, so a window's gradient is the mean of the micro-batches' mean losses: wrong when they
hold different numbers of items (tokens of variable-length sequences, the epoch's short last
batch, the short last window, which Lightning still divides by k). The full window's loss is

    L = sum_m sum_{items of m} loss_item / N = sum_m n_m * loss_m / N,   N = sum_m n_m over all ranks.

N is only known at the window's end, so the callback backpropagates sums and divides once:

1. ``training_step`` returns ``{"loss": loss_m, "items": n_m}`` (loss_m the micro-batch's mean);
   the callback wraps it to hand Lightning ``k * n_m * loss_m``, so Lightning's ``/ k`` leaves
   ``n_m * loss_m``, the micro-batch's summed loss, and the accumulated gradient is
   ``sum_m n_m * grad(loss_m)`` on each rank;
2. before the optimizer step (before Lightning clips), ``N`` is summed over the ranks and every
   gradient multiplied by ``W / N``: DDP averaged the W ranks' sums, so the result is
   ``sum_{ranks, m} n_m grad(loss_m) / N``, the full window's gradient.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from ..errors import ConfigError
from ..planner import Plan

logger = logging.getLogger(__name__)

__all__ = ["ExactAccumulation"]


def _items_of(output: Any, batch: Any, count_items: Callable[[Any], int] | None) -> Any:
    if count_items is not None:
        return count_items(batch)
    if isinstance(output, dict) and "items" in output:
        return output["items"]
    raise ConfigError(
        "ExactAccumulation: training_step must return {'loss': mean_loss, 'items': n} (n = the items the "
        "mean averages over: tokens, samples), or pass ExactAccumulation(count_items=fn(batch) -> n)"
    )


class ExactAccumulation(pl.Callback):
    """Make ``Trainer(accumulate_grad_batches=k)`` step with the full window's gradient.

    ``count_items(batch)`` counts a batch's items when ``training_step`` returns a bare loss.
    ``plan`` (from ``microbatch.plan``) sets the trainer's ``accumulate_grad_batches`` to its steps and
    checkpoints its blocks of ``model`` (default: the LightningModule itself; pass the network the
    plan was made for when the workload's model is a part of it); the dataloader's batch size is
    yours to set to ``plan.micro_batch_size`` (a warning says when the first batch differs).
    """

    def __init__(
        self,
        *,
        count_items: Callable[[Any], int] | None = None,
        plan: Plan | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.count_items = count_items
        self.plan = plan
        self.model = model
        self.window_items = 0.0  # n summed over this rank's micro-batches since the last step
        self._checked_batch = False
        self._handle: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "ExactAccumulation is for automatic optimization; with automatic_optimization=False use "
                "microbatch.Accumulator in training_step (examples/lightning_manual.py)"
            )
        if self.plan is not None:
            trainer.accumulate_grad_batches = self.plan.steps
            self._handle = self.plan.checkpoint(self.model if self.model is not None else pl_module)
        self._wrap_training_step(trainer, pl_module)
        logger.info(
            "ExactAccumulation: each micro-batch weighted by its items, the window divided by their total "
            "(accumulate_grad_batches=%d)",
            trainer.accumulate_grad_batches,
        )

    def _wrap_training_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        training_step = pl_module.training_step  # bound: the class's method
        callback = self

        def weighted_training_step(module: pl.LightningModule, batch: Any, *args: Any, **kwargs: Any) -> Any:
            output: Any = training_step(batch, *args, **kwargs)
            if output is None:
                return None  # a skipped batch: Lightning backpropagates nothing
            loss: torch.Tensor = output["loss"] if isinstance(output, dict) else output
            items = torch.as_tensor(_items_of(output, batch, callback.count_items), dtype=torch.float64)
            callback.window_items += float(items)
            # k * n * mean: Lightning divides by k, leaving the micro-batch's summed loss. An empty
            # micro-batch contributes zero (its mean is 0 / 0).
            scale = float(trainer.accumulate_grad_batches) * float(items)
            summed = torch.where(items.to(loss.device) > 0, loss, torch.zeros_like(loss)) * scale
            return {**output, "loss": summed} if isinstance(output, dict) else summed

        pl_module.training_step = types.MethodType(weighted_training_step, pl_module)  # type: ignore[method-assign]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
    ) -> None:
        if self.plan is None or self._checked_batch:
            return
        self._checked_batch = True
        first = next((t for t in _tensors(batch)), None)
        if first is not None and first.dim() > 0 and first.shape[0] != self.plan.micro_batch_size:
            logger.warning(
                "ExactAccumulation: the plan's micro-batch is %d samples but the dataloader gives %d; "
                "set DataLoader(batch_size=%d)",
                self.plan.micro_batch_size,
                first.shape[0],
                self.plan.micro_batch_size,
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                "ExactAccumulation supports one optimizer; configure_optimizers returned several"
            )
        local = torch.tensor(self.window_items, dtype=torch.float64, device=pl_module.device)
        total = float(trainer.strategy.reduce(local, reduce_op="sum"))
        self.window_items = 0.0
        # The gradient holds sum_m n_m grad(loss_m), averaged over the W ranks by DDP: times W / N.
        scale = trainer.world_size / total if total > 0 else 0.0
        with torch.no_grad():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        parameter.grad.mul_(scale)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and "training_step" in vars(pl_module):
            del pl_module.training_step  # back to the class's method
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []
