"""Lightning's automatic optimization made exact: ``ExactAccumulation`` (``pip install lightning``).

``Trainer(accumulate_grad_batches=k, callbacks=[ExactAccumulation()])`` with a LightningModule whose
``training_step`` returns ``{"loss": mean_loss, "items": n}`` steps with the full window's gradient,
however many items (tokens, samples) each micro-batch holds and however short the epoch's last
window is; ``ExactAccumulation(plan=mb.plan(...))`` also applies a plan's accumulation and
checkpointing (see ``callback``). Importing this package imports lightning.

May import: errors, trees, memory, workload, distributed, accumulate, checkpointing, planner.
"""

from __future__ import annotations

from .callback import ExactAccumulation

__all__ = ["ExactAccumulation"]
