"""Byte sizes: a device's memory, and budgets parsed from "8GiB" / "80%"."""

from __future__ import annotations

import logging
import math
import re

import torch

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "BYTES_RULE",
    "device_free_bytes",
    "device_memory_bytes",
    "fraction_base_bytes",
    "parse_bytes",
]

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


def device_free_bytes(device: torch.device | str | None = None) -> int:
    """Memory free on a device now: the CUDA driver's free bytes, the machine's available RAM for the CPU."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        import os

        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
        except (ValueError, OSError):
            pass
    return device_memory_bytes(device)


def fraction_base_bytes(device: torch.device | str | None = None) -> int:
    """What a fractional budget is a fraction of: the device's free memory now.

    On CUDA, free counts what this process's caching allocator holds (the model already loaded, its
    cache) as well as what the driver reports free: both are this process's to plan with. On the
    CPU, the RAM available (MemAvailable).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes) + int(torch.cuda.memory_reserved(device))
    return device_free_bytes(device)


BYTES_RULE = (
    "a size with an optional unit ('8GiB', '300MiB', '1.5G', '1000000' bytes), or a fraction of the "
    "device's free memory at plan time ('80%', or a decimal in (0, 1] such as '0.8')"
)


MAX_BYTES = 1 << 62  # 4 EiB: more than any device's memory; a larger size is a typo


def parse_bytes(
    size: str | int | float, *, device: torch.device | str | None = None, name: str = "memory"
) -> int:
    """Bytes from a size or a fraction of ``device``'s free memory: one rule.

    A fraction is written as a percentage ("80%", in (0 %, 100 %]) or as a float in (0, 1] (1.0,
    0.8, "0.8", "5e-1"), and means that share of the memory free on ``device`` when this is called
    (plan time; on CUDA also what this process's allocator holds, see fraction_base_bytes).
    Anything else is a byte count with an optional unit ("8GiB", "300MiB", "1.5G"; SI: G = 10^9,
    GiB = 2^30): an int or integer literal (1 = one byte, "1e3" = 1000 bytes), and
    without a unit it must be whole ("1.5" is refused: bytes are whole; write "1.5KB" or "0.5").
    """
    if isinstance(size, bool):
        raise ConfigError(f"{name} must be {BYTES_RULE}; got {size!r}")
    if isinstance(size, str):
        text = size.strip()
        if text.endswith("%"):
            return _percent_of_free(text[:-1], size, device=device, name=name)
        match = _SIZE.match(text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{name}={size!r} is not a size; write {BYTES_RULE}")
        literal, unit = match.group(1), match.group(2).lower()
        is_float = any(c in literal for c in ".eE")
        if unit == "" and is_float:
            return parse_bytes(float(literal), device=device, name=name)
        value = float(literal) * _UNITS[unit] if is_float else int(literal) * _UNITS[unit]
        if unit in ("", "b") and value != int(value):
            raise ConfigError(f"{name}={size!r}: bytes are whole; write {BYTES_RULE}")
    elif isinstance(size, float):
        if not math.isfinite(size) or size <= 0:
            raise ConfigError(f"{name} must be positive and finite, got {size!r}; write {BYTES_RULE}")
        if size <= 1:
            return max(1, int(size * fraction_base_bytes(device)))
        if size != int(size):
            raise ConfigError(
                f"{name}={size!r}: a float above 1 is a byte count and bytes are whole; write {BYTES_RULE}"
            )
        value = size
    elif isinstance(size, int):
        value = size
    else:
        raise ConfigError(f"{name} must be {BYTES_RULE}; got {type(size).__name__}")
    if not math.isfinite(value) or value > MAX_BYTES:  # 1e400GiB: inf, which int() cannot take
        raise ConfigError(
            f"{name}={size!r} is more than any machine has (at most {MAX_BYTES:,} bytes, 4 EiB); "
            f"write {BYTES_RULE}"
        )
    if value < 1:
        raise ConfigError(f"{name} must be at least one byte, got {size!r}; write {BYTES_RULE}")
    return int(value)


def _percent_of_free(number: str, size: str, *, device: torch.device | str | None, name: str) -> int:
    try:
        percent = float(number)
    except ValueError:
        raise ConfigError(f"{name}={size!r} is not a percentage; write {BYTES_RULE}") from None
    if not (0 < percent <= 100):
        raise ConfigError(f"{name}={size!r}: a percentage of free memory must be in (0 %, 100 %]")
    return max(1, int(percent / 100 * fraction_base_bytes(device)))
