"""Byte counts written for people: binary units, three significant digits."""

from __future__ import annotations

import math


def format_bytes(num_bytes: float) -> str:
    """Binary units with three significant digits: 1536 -> '1.50 KiB'."""
    sign = "-" if num_bytes < 0 else ""
    value = float(abs(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value >= 100 else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bytes_at_least(num_bytes: int) -> str:
    """Like format_bytes, rounded up instead of to nearest: a minimum that, given back as it reads
    (memory="683 KiB"), is never below ``num_bytes``. 698,756 bytes -> '683 KiB' (format_bytes: '682 KiB')."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{math.ceil(value)} B"
    digits = 0 if value >= 100 else 2
    return f"{math.ceil(value * 10**digits) / 10**digits:.{digits}f} {unit}"
