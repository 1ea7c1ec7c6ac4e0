"""Output that never costs a run: a write to stdout or stderr that fails is dropped, never raised.

The progress line, the planner's bar, log records and the final summary are for a person; the run
folder is the record. When the terminal is gone (a hang-up: EIO), stderr is a file on a full disk
(ENOSPC) or the reader of a pipe has left (EPIPE), the write fails; the run goes on. The failing
stream's descriptor is pointed at /dev/null once, so later writes (and Python's flush at exit,
which would otherwise turn the exit status into 120) succeed silently.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import TextIO


def silence(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null and drop what its buffer holds."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        stream.flush()  # the buffered text goes to /dev/null now


def write(stream: TextIO, text: str) -> bool:
    """Write ``text`` to ``stream`` and flush it; False (the stream silenced) when that failed."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # ValueError: the stream was closed
        silence(stream)
        return False
    return True
