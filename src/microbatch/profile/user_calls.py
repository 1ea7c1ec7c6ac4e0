"""What microbatch was doing when the user's own code raised: a note on the error, not a new error.

``mb.plan`` calls the workload's ``make_batch``, ``loss`` and (through the loss's backward) the
model many times, at sizes the user never chose. An error there is the user's, and stays theirs:
its type, message and traceback are unchanged, so ``except ValueError`` around ``mb.plan`` still
catches it; PEP 678's ``add_note`` adds one line saying which call, which micro-batch size and which
phase of planning raised it (shown under the traceback from Python 3.11, and by the CLI in its one line).
Replacing it with a WorkloadError chained ``from`` it would say the same but break those handlers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import PLANNING_NOTE_PREFIX, MicrobatchError, planning_notes
from ..memory.oom import is_out_of_memory


@contextlib.contextmanager
def noted_user_call(workload_name: str, call: str, doing: str) -> Iterator[None]:
    """An exception raised inside leaves with a note: ``call`` of workload ``workload_name`` raised it
    while microbatch was ``doing`` (the innermost note only: an outer one adds nothing). microbatch's
    own errors and out-of-memory errors (handled by the planner) get none."""
    try:
        yield
    except Exception as error:
        ours = isinstance(error, MicrobatchError) or is_out_of_memory(error)
        if not ours and not planning_notes(error):
            # add_note's own work (PEP 678), spelled out for Python 3.10, which shows no notes but keeps them
            notes = getattr(error, "__notes__", None)
            if not isinstance(notes, list):
                notes = []
                error.__notes__ = notes  # type: ignore[attr-defined]
            what = f"workload {workload_name!r} raised this in {call} while {doing}"
            notes.append(PLANNING_NOTE_PREFIX + what)
        raise
