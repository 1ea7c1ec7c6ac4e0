"""``--json`` output: indented objects, with each list of plain values on one line.

``json.dumps(indent=2)`` gives every element its own line, so a plan of 512 micro-batches printed
512 lines of sizes. Lists of numbers, strings, booleans and nulls are written inline instead; objects
and lists of objects stay indented. The text is still exactly the same JSON value.
"""

from __future__ import annotations

import json
from typing import Any


def dumps(value: Any, *, indent: int = 2, sort_keys: bool = False, level: int = 0) -> str:
    """``value`` as JSON, indented, its lists of plain values on one line."""
    pad, inner = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(value, dict) and value:
        items = sorted(value.items()) if sort_keys else list(value.items())
        lines = [
            f"{inner}{json.dumps(str(key))}: "
            + dumps(item, indent=indent, sort_keys=sort_keys, level=level + 1)
            for key, item in items
        ]
        return "{\n" + ",\n".join(lines) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)) and value:
        if all(not isinstance(item, (dict, list, tuple)) for item in value):
            return json.dumps(list(value))
        lines = [
            f"{inner}{dumps(item, indent=indent, sort_keys=sort_keys, level=level + 1)}" for item in value
        ]
        return "[\n" + ",\n".join(lines) + f"\n{pad}]"
    return json.dumps(value)
