"""The planner's progress on stderr, drawn like training's: a bar, what runs, time spent and left.

The planner reports ``progress(what, done, total)`` (microbatch.profile, planner.trial); library
code never draws (STYLE.md), so the commands do it here, for ``microbatch plan`` and for the
planning that ``microbatch train`` does before its first step. A phase (profiling, simulating,
profiling again at larger sizes, the trial) starts its own clock; the estimate is the phase's
elapsed time per run times the runs left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from . import quiet

BAR_WIDTH = 20


def clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PlanningBar:
    """One line redrawn with \\r on a terminal (ended when its phase ends); in a log, a line at each
    phase's start and quarters."""

    def __init__(self, stream: TextIO, *, now: Callable[[], float] = time.perf_counter) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self.now = now
        self.total = 0
        self.done = 0
        self.phase_start = 0.0
        self.quarter = -1
        self.width = 0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = self.now()
        if total != self.total or done < self.done:  # a new phase: its own clock and quarters
            self.phase_start, self.quarter = now, -1
        self.total, self.done = total, done
        line = self.format(what, done, total, now - self.phase_start)
        if self.live:
            text = "\r" + line.ljust(self.width)
            self.width = len(line)
            if done >= total or total <= 1:  # a phase over, or one event: keep it, logs start below
                text += "\n"
                self.width = 0
            quiet.write(self.stream, text)  # a failed write is dropped: output never costs a run
        elif total <= 1 or done * 4 // total != self.quarter:
            self.quarter = done * 4 // total if total > 1 else -1
            quiet.write(self.stream, line + "\n")

    @staticmethod
    def format(what: str, done: int, total: int, elapsed_seconds: float) -> str:
        if total <= 1:
            return f"planning: {what} | {clock(elapsed_seconds)}"
        filled = BAR_WIDTH * done // total
        left = f", ETA {clock(elapsed_seconds / done * (total - done))}" if 0 < done < total else ""
        return (
            f"planning [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} {what} | "
            f"{clock(elapsed_seconds)}{left}"
        )

    def close(self) -> None:
        """Clear the live line, so what is printed next starts at the left edge."""
        if self.live and self.width:
            quiet.write(self.stream, "\r" + " " * self.width + "\r")
            self.width = 0
