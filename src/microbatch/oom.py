"""Recognising an out-of-memory failure, and freeing what it left behind.

One place for "did this run out of memory?", shared by the profiler, the planner's trial and the
training loop, so that every caller treats the same failures as an OOM.
"""

from __future__ import annotations

import gc

import torch


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
