"""Exact gradient accumulation in a Lightning module (manual optimization) with microbatch.

    pip install -e . lightning                        # from the microbatch checkout
    python examples/lightning_manual.py               # a second on a CPU

Lightning's automatic accumulation (``accumulate_grad_batches``) divides every micro-batch's loss
by the number of micro-batches: wrong when micro-batches differ in size (the epoch's short last
batch) or carry different numbers of tokens. Here the module optimizes manually and hands each
micro-batch to a ``microbatch.Accumulator``, which weights it by its item count and divides once by
the window's total.

Two details matter:

- Pass ``self.optimizers()`` (Lightning's wrapper), not the raw optimizer: its ``step()`` is what
  advances ``trainer.global_step``, so schedulers, logging and checkpoint intervals count optimizer
  steps. With the raw optimizer training is just as exact, but ``global_step`` stays 0.
- The Accumulator calls ``backward`` itself, as ``manual_backward`` would on one 32-bit CPU or GPU
  process. Under a Lightning precision plugin (16-bit) or a DDP strategy, Lightning's own
  ``manual_backward`` scales and synchronises; use the Accumulator there only with the wrapped model
  and ``scaler=`` it needs, or accumulate with Lightning itself.

A window that the epoch's end leaves short is finished with ``step(partial=True)`` in the epoch's
last ``training_step`` (an optimizer step in ``on_train_epoch_end`` would not advance
``global_step``): still exact.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import microbatch as mb


class Regressor(L.LightningModule):
    def __init__(self, *, steps: int, lr: float = 0.1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.steps, self.lr = steps, lr
        self.accumulator: mb.Accumulator | None = None
        self.in_window = 0  # micro-batches since the last optimizer step
        self.window_losses: list[float] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_start(self) -> None:
        # self.optimizers(): Lightning's optimizer, whose step() advances trainer.global_step.
        self.accumulator = mb.Accumulator(self, self.optimizers(), steps=self.steps)  # type: ignore[arg-type]

    def training_step(self, batch: Any, batch_idx: int) -> None:
        assert self.accumulator is not None
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.accumulator.backward(loss, items=x.shape[0])  # weighted by its samples
        self.in_window += 1
        # The epoch's last batch ends a window even when it is short (num_training_batches: a loader
        # with a length). Stepping here, inside training_step, is what global_step counts.
        epoch_ends = batch_idx + 1 == self.trainer.num_training_batches
        if self.in_window == self.steps or epoch_ends:
            self._step(partial=self.in_window < self.steps)

    def _step(self, *, partial: bool = False) -> None:
        assert self.accumulator is not None
        stats = self.accumulator.step(partial=partial)
        self.window_losses.append(stats.loss)
        self.log("window_loss", stats.loss)
        self.in_window = 0


def data(num_samples: int = 26, *, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main(argv: Sequence[str] | None = None) -> tuple[Regressor, L.Trainer]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=26, help="training samples (default 26)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="micro-batches per optimizer step (default 3)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = Regressor(steps=args.steps)
    loader = DataLoader(data(args.samples), batch_size=args.micro_batch, shuffle=False)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    print(f"optimizer steps (trainer.global_step): {trainer.global_step}")
    print("window losses:", ", ".join(f"{loss:.4f}" for loss in module.window_losses))
    return module, trainer


if __name__ == "__main__":
    main()
