"""Recognising an out-of-memory failure, and freeing what it left behind.

One place for "did this run out of memory?", shared by the profiler, the planner's trial and the
training loop, so that every caller treats the same failures as an OOM.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def is_out_of_memory(error: BaseException) -> bool:
    """True for torch's out-of-memory error on any device, and the CPU allocator's failure."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand cached device memory back after an out-of-memory error."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attempt(run: Callable[[], T], device: torch.device) -> T | None:
    """``run()``'s result, or None when it ran out of memory (then memory is freed).

    The one "try, and recognise an OOM" of the package: any other error propagates. The memory is
    freed outside the except block, where the failed frame's tensors are no longer referenced.
    """
    out_of_memory = False
    try:
        return run()
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
        out_of_memory = True
    if out_of_memory:
        free_memory(device)
    return None
