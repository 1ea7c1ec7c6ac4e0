"""The clock a profile's timings are read from: wall time, or the profiling thread's CPU time.

"wall" (time.perf_counter) is what a step takes and what the planner predicts by default. On a
machine other jobs share, though, a wall-clock interval also holds the time slices the scheduler
gave those jobs, so two timings of the same work differ by the load of their moment (a profile
taken at load 2 and training timed at load 4 differ about 2x on 2 cores), and no time model can
predict that. "cpu" (time.thread_time) counts only the CPU time of the thread doing the work: on a
CPU device with one torch thread, forward, backward (CPU autograd runs on the calling thread) and
the optimizer step all run on it, so its CPU time is the wall time on a core of its own. With more
torch threads the work spreads over threads this clock does not see, so "cpu" needs exactly one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..errors import ConfigError

WALL, CPU = "wall", "cpu"
CLOCKS = (WALL, CPU)


def clock_for(name: str, device: torch.device) -> Callable[[], float]:
    """The clock ``name`` ("wall" or "cpu") as a function returning seconds, checked for ``device``."""
    if name == WALL:
        return time.perf_counter
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
