"""A plan file written so a reader sees the old plan or the new one, never a part of either.

``Plan.save`` and ``microbatch plan --out`` write the JSON to a temporary file in the same folder,
fsync it and rename it over ``path`` (atomic on POSIX): a write cut short (a kill, a full disk)
leaves the old plan as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import uuid


def write_plan_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename); OSError when it fails."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):
        folder = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
