"""A memory budget on the CPU: out of memory above it, judged per micro-batch size from measured windows."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from microbatch.memory import MemoryTracker

from .nanogpt_peer import loop_nanogpt
from .protocol import Setup, adamw, hf_checkpoint_every_layer, lm_loss, token_batches


class SimulatedBudget:
    """Out of memory above ``budget_bytes``, judged per micro-batch size from measured windows.

    ``peak_bytes(b)`` is the peak of a steady-state window of the plain loop at micro-batch ``b``
    (AdamW's state already made, two micro-batches, clipping, the step) under MemoryTracker.
    ``guard(model)`` makes the model's forward raise the CPU allocator's out-of-memory error for a
    micro-batch whose window would not fit, which is what find_executable_batch_size and Lightning's
    finder catch on a real device.
    """

    def __init__(self, setup: Setup, base: nn.Module) -> None:
        self.setup, self.base = setup, base
        self.budget_bytes = 0
        self._peaks: dict[tuple[bool, int], int] = {}

    def peak_bytes(self, size: int, *, hf_checkpoint: bool = False) -> int:
        if (hf_checkpoint, size) not in self._peaks:
            model = copy.deepcopy(self.base)
            model.train()
            if hf_checkpoint:
                hf_checkpoint_every_layer(model)
            optimizer = adamw(model)
            warm, *window = token_batches(self.setup, 3, size, seed=99)
            loop_nanogpt(model, optimizer, [warm], loss=lm_loss, steps=1, max_grad_norm=1.0)
            with MemoryTracker(model=model, optimizer=optimizer) as tracker:
                loop_nanogpt(model, optimizer, window, loss=lm_loss, steps=2, max_grad_norm=1.0)
            self._peaks[hf_checkpoint, size] = tracker.peak_bytes
        return self._peaks[hf_checkpoint, size]

    def fits(self, size: int, *, hf_checkpoint: bool = False) -> bool:
        return self.peak_bytes(size, hf_checkpoint=hf_checkpoint) <= self.budget_bytes

    def guard(self, model: nn.Module, *, hf_checkpoint: bool = False) -> Any:
        def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            size = int((args[0] if args else kwargs["input_ids"]).shape[0])
            if not self.fits(size, hf_checkpoint=hf_checkpoint):
                raise RuntimeError(
                    "DefaultCPUAllocator: can't allocate memory: simulated budget of "
                    f"{self.budget_bytes} bytes, micro-batch {size}"
                )

        return model.register_forward_pre_hook(check, with_kwargs=True)
