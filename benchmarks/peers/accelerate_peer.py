"""Accelerate: ``accumulate()``, and under a budget ``find_executable_batch_size``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .protocol import loader


def loop_accelerate(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # Accelerate keeps its state in process-wide singletons
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=kw["steps"], cpu=not torch.cuda.is_available())
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(micro_batches))
    for batch in data:
        with accelerator.accumulate(model):
            accelerator.backward(kw["loss"](model, batch)[0])  # divides by gradient_accumulation_steps
            if accelerator.sync_gradients and kw["max_grad_norm"] is not None:
                accelerator.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
            optimizer.step()  # skipped until the window's last micro-batch, or the data's end
            optimizer.zero_grad()


def accelerate_finder(start: int, fits: Callable[[int], bool]) -> int:
    """The size Accelerate's find_executable_batch_size settles on, starting from ``start``."""
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=start)
    def probe(batch_size: int) -> int:
        if not fits(batch_size):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: simulated budget")
        return batch_size

    return int(probe())
