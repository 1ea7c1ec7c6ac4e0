"""A plan file written so a reader sees the old plan or the new one, never a part of either.

``Plan.save`` and ``microbatch plan --out`` write the JSON to a temporary file in the same folder,
fsync it and rename it over ``path`` (atomic on POSIX): a write cut short (a kill, a full disk)
leaves the old plan as it was and no temporary file behind. The JSON carries a checksum
(``sealed_json``) that ``Plan.load`` checks (``check_checksum``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from typing import Any

from ...errors import ConfigError


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


# A plan file carries a checksum of the rest of it, checked by Plan.load: a bit flipped on a disk or
# by a copy, or an edit, is refused with the file's name. A plan without one (saved by an older
# microbatch, or edited on purpose with the field removed) loads as before.
CHECKSUM_FIELD = "checksum"


def _digest(data: dict[str, Any]) -> str:
    # The JSON of every other field, in the file's own key order (json keeps it both ways).
    body = {key: value for key, value in data.items() if key != CHECKSUM_FIELD}
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def sealed_json(data: dict[str, Any]) -> str:
    """``data`` as the plan file's JSON, with its checksum as the last field."""
    return json.dumps({**data, CHECKSUM_FIELD: _digest(data)}, indent=2) + "\n"


def check_checksum(data: object) -> None:
    """ConfigError when ``data`` (a plan file, parsed) carries a checksum its contents do not match."""
    if not isinstance(data, dict) or CHECKSUM_FIELD not in data:
        return
    if data[CHECKSUM_FIELD] != _digest(data):
        raise ConfigError(
            f"fails its checksum ({CHECKSUM_FIELD!r}): the file changed after it was saved (a damaged "
            "disk or copy, or an edit). Make the plan again (mb.plan(...).save(path), or microbatch plan "
            f"... --out), or, for an edit you made on purpose, delete the {CHECKSUM_FIELD!r} field"
        )
