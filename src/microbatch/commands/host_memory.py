"""A host allocation that failed (``ulimit -v``, a container's limit), said as what it is.

torch's CPU allocator raises RuntimeError "DefaultCPUAllocator: can't allocate memory: you tried to
allocate N bytes"; Python raises MemoryError. Neither is a bug in microbatch or in the user's code:
the batch asked for more host memory than the process may have. The line names the allocation,
the batch that asked for it, why that command holds it, and the fix.
"""

from __future__ import annotations

import argparse
import re

from ..memory import format_bytes

# Why each command holds a batch in host memory at once.
_HOLDS = {
    "verify": "verify makes the whole batch at once (it compares with the full-batch gradient)",
    "train": "train makes each optimizer step's batch at once on the host, then splits it into micro-batches",
    "plan": "planning runs the workload's micro-batches on the host",
}


def host_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def host_memory_line(command: str, error: BaseException, args: argparse.Namespace) -> str:
    """One line for a failed host allocation during ``command``."""
    asked = re.search(r"tried to allocate (\d+) bytes", str(error))
    what = f"allocating {format_bytes(int(asked.group(1)))}" if asked else "allocating"
    batch = getattr(args, "batch", None)
    for_batch = f" for --batch {batch:,}" if isinstance(batch, int) else ""
    why = _HOLDS.get(command, f"{command} holds its data in host memory")
    return (
        f"the host ran out of memory {what}{for_batch} ({type(error).__name__}: the process's memory "
        f"limit, ulimit -v or the container's, or the machine's memory): {why}. Lower --batch, or raise "
        "the memory limit"
    )
