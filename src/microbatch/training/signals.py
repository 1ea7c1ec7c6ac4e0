"""Stopping a run on a signal without losing work: the signals a user's session or scheduler sends.

Handled alike (``STOP_SIGNALS``): SIGINT (Ctrl-C), SIGTERM (kill, schedulers, torchrun), SIGHUP
(the terminal or SSH session closed), SIGUSR1 and SIGUSR2 (Slurm's ``--signal`` sends SIGUSR1 by
default before a time limit; SGE sends SIGUSR1 / SIGUSR2 before a kill), and SIGXCPU (a soft CPU
time limit: ulimit -t, Slurm and SGE CPU limits). All of these end the process by default, so
catching them only turns a lost window into a saved one. A signal the process was started with
ignored (``nohup`` ignores SIGHUP) stays ignored. Not caught: SIGKILL and SIGSTOP (they cannot
be), SIGQUIT (asks for a core dump), SIGPIPE (a closed pipe), SIGALRM (a program's own timer).

The first stop signal asks the loop to stop at the next window boundary: the window in progress
finishes, the checkpoint is saved, summary.json is written and the resume command is printed; the
command then exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), as
a process killed by it would. A second signal stops at once (KeyboardInterrupt / SystemExit):
checkpoints are written to a temporary file and renamed, so the last complete one survives.
Under torchrun every rank agrees on stopping at the same window (``agreed``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .. import distributed
from ..profile.stash import polite_signals_exit

logger = logging.getLogger(__name__)

STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")
    if hasattr(signal, name)  # SIGHUP, SIGUSR1/2 and SIGXCPU are POSIX only
)


def exit_status(signal_name: str | None) -> int:
    """128 + the signal's number for a run stopped by it; 0 otherwise."""
    if signal_name is None:
        return 0
    return 128 + int(signal.Signals[signal_name])


@contextlib.contextmanager
def exit_on_stop_signals() -> Iterator[None]:
    """Before training (planning, building the session): a stop signal other than SIGINT raises
    SystemExit(128 + its number), so ``finally`` clauses run (the planner's stash file, a new
    run's marker, lock and folder are removed) instead of the process dying at once. The planner's
    own guard (profile/stash.py): STOP_SIGNALS less SIGINT, those with a handler of their own or
    ignored left as they are, restored afterwards."""
    with polite_signals_exit():
        yield


class StopFlag:
    """The first stop signal sets ``requested`` (and ``signal_name``); a second one aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self._restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if distributed.is_rank_zero():
            logger.warning(
                "%s: finishing this optimizer step, then saving (send it again to stop at once)",
                self.signal_name,
            )

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue  # ignored on purpose (nohup): stays ignored
            self._previous[signum] = signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            self._restore()

    def agreed(self) -> tuple[bool, str | None]:
        """(stop, signal name) on every rank when any rank was asked to stop (one all-reduce)."""
        if distributed.world_size() == 1:
            return self.requested, self.signal_name
        code = float(int(signal.Signals[self.signal_name])) if self.signal_name else 0.0
        (flag,) = distributed.all_reduce_values([code], op="max")
        return flag > 0, signal.Signals(int(flag)).name if flag > 0 else None
