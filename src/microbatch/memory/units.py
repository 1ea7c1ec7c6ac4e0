"""Byte counts written for people: binary units, three significant digits."""

from __future__ import annotations


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
