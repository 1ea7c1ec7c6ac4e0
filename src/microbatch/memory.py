"""Byte sizes in human units, and (MemoryTracker) peak live tensor memory by category."""

from __future__ import annotations

import math
import re

import torch

from .errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def device_memory_bytes(device: torch.device | str | None = None) -> int:
    """Total memory of a device: the GPU's for CUDA, the machine's RAM for the CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_bytes(
    size: str | int | float, *, device: torch.device | str | None = None, name: str = "memory"
) -> int:
    """Bytes from "8GiB", "300MiB", "1.5G" (SI: G = 10^9, GiB = 2^30), an int, or a fraction in (0, 1].

    A float in (0, 1] (or such a string, "0.8") means that fraction of ``device``'s memory.
    """
    if isinstance(size, bool):
        raise ConfigError(f"{name} must be a size like '8GiB', got {size!r}")
    if isinstance(size, str):
        match = _SIZE.match(size)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}={size!r} is not a size; write it like '8GiB', '300MiB', '1.5G', '1000000' "
                "or a fraction of the device's memory such as '0.8'"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit == "" and 0 < number <= 1 and "." in match.group(1):
            return parse_bytes(number, device=device, name=name)
        value = number * _UNITS[unit]
    elif isinstance(size, float):
        if not math.isfinite(size) or size <= 0:
            raise ConfigError(f"{name} must be positive and finite, got {size!r}")
        if size <= 1:
            return int(size * device_memory_bytes(device))
        value = size
    elif isinstance(size, int):
        value = size
    else:
        raise ConfigError(
            f"{name} must be a size like '8GiB' or a number of bytes, got {type(size).__name__}"
        )
    if value < 1:
        raise ConfigError(f"{name} must be at least one byte, got {size!r}")
    return int(value)


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
