"""The clock a profile's timings are read from: wall time, or the profiling thread's CPU time.

"wall" (time.perf_counter) is what a step takes and what the planner predicts by default. On a
machine other jobs share, though, a wall-clock interval also holds the time slices the scheduler
gave those jobs, so two timings of the same work differ by the load of their moment (a profile
taken at load 2 and training timed at load 4 differ about 2x on 2 cores), and no time model can
predict that. "cpu" (time.thread_time) counts only the CPU time of the thread doing the work: on a
CPU device with one torch thread, forward, backward (CPU autograd runs on the calling thread) and
the optimizer step all run on it, so its CPU time is the wall time on a core of its own. With more
torch threads the work spreads over threads this clock does not see, so "cpu" needs exactly one.

"auto" (the profiler's default) is "cpu" on a CPU device, with torch set to one thread while the
profile runs and put back after (``profiling_clock``): its times are then one thread's CPU seconds,
what the work costs whatever else the machine runs, and they rank plans as a quiet machine would
(on a loaded one wall timings of identical layers spread 16x; issue 32). On any other device it is
"wall": a CUDA kernel's time is the GPU's, which the profiler reads after synchronizing, and other
processes' CPU load does not stretch it the way it stretches a CPU thread's turn on a core.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from ..errors import ConfigError

WALL, CPU, AUTO = "wall", "cpu", "auto"
CLOCKS = (AUTO, WALL, CPU)


def clock_for(name: str, device: torch.device) -> Callable[[], float]:
    """The clock ``name`` ("wall" or "cpu") as a function returning seconds, checked for ``device``."""
    if name == WALL:
        return time.perf_counter
    if name == AUTO:
        raise ConfigError("clock='auto' is resolved by profiling_clock; pass 'wall' or 'cpu' here")
    if name != CPU:
        raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {name!r}")
    if device.type != "cpu":
        raise ConfigError(
            f"clock='cpu' times the profiling thread's CPU work, but the model is on {device}, whose "
            "kernels run elsewhere; use clock='wall'"
        )
    threads = torch.get_num_threads()
    if threads != 1:
        raise ConfigError(
            f"clock='cpu' needs torch to run on one thread (the one it times), but "
            f"torch.get_num_threads() is {threads}; call torch.set_num_threads(1) or use clock='wall'"
        )
    return time.thread_time


@contextlib.contextmanager
def profiling_clock(name: str, device: torch.device) -> Iterator[tuple[str, Callable[[], float]]]:
    """The clock's resolved name and reader for a profile of a model on ``device``, for the ``with``
    block. "auto" is "cpu" on a CPU device (torch on one thread inside the block, its thread count
    restored after) and "wall" elsewhere; "wall" and "cpu" are as ``clock_for`` checks them."""
    chosen = (CPU if device.type == "cpu" else WALL) if name == AUTO else name
    threads = torch.get_num_threads()
    one_thread = name == AUTO and chosen == CPU and threads != 1
    if one_thread:
        torch.set_num_threads(1)
    try:
        yield chosen, clock_for(chosen, device)
    finally:
        if one_thread:
            torch.set_num_threads(threads)


def clock_note(name: str, threads: int) -> str | None:
    """The plan's note on what the predicted seconds are, for a profile read from clock ``name``
    while torch ran ``threads`` threads outside the profile; None for the wall clock."""
    if name != CPU:
        return None
    outside = (
        f"; training runs on {threads} threads, so a step's wall time may be shorter" if threads > 1 else ""
    )
    return (
        "timed on the CPU clock of one thread (time.thread_time, torch on 1 thread while profiling): "
        f"predicted seconds are that thread's CPU seconds, which other processes do not inflate{outside}"
    )
