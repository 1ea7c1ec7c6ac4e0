"""Lightning: ``Trainer(accumulate_grad_batches)``, and under a budget its batch-size finder."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .protocol import LossFn, adamw, lm_loss, loader, token_batches
from .simulated_budget import SimulatedBudget


def lightning_trainer(*, steps: int, max_grad_norm: float | None, precision: str, **options: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="auto",
        devices=1,
        accumulate_grad_batches=steps,
        gradient_clip_val=max_grad_norm,
        precision=precision,  # type: ignore[arg-type]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


def lightning_module(
    model: nn.Module, loss: LossFn, make_optimizer: Callable[[nn.Module], Any], **attributes: Any
) -> Any:
    """A LightningModule around ``model`` whose training_step returns the micro-batch's mean loss."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            for key, value in attributes.items():
                setattr(self, key, value)

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            return loss(self.model, batch)[0]

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.model)

    return Module()


def loop_lightning(model: Any, make_optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    precision = "64-true" if next(model.parameters()).dtype == torch.float64 else "32-true"
    trainer = lightning_trainer(
        steps=kw["steps"], max_grad_norm=kw["max_grad_norm"], precision=precision, max_epochs=1
    )
    trainer.fit(lightning_module(model, kw["loss"], make_optimizer), loader(micro_batches))


def lightning_finder(budget: SimulatedBudget, start: int, steps: int) -> int:
    """Lightning's Tuner.scale_batch_size (binary search) on the guarded model."""
    from lightning.pytorch.tuner import Tuner

    model = copy.deepcopy(budget.base)
    handle = budget.guard(model)
    samples = token_batches(budget.setup, 1, 8 * start, seed=5)[0]
    rows = [{key: value[i] for key, value in samples.items()} for i in range(8 * start)]
    module = lightning_module(model, lm_loss, adamw, batch_size=start)
    module.train_dataloader = lambda: torch.utils.data.DataLoader(rows, batch_size=module.batch_size)
    trainer = lightning_trainer(steps=steps, max_grad_norm=1.0, precision="32-true", max_steps=1)
    try:
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=start, steps_per_trial=1)
    finally:
        handle.remove()
    return int(found if found is not None else module.batch_size)
