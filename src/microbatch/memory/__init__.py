"""Measure: what a training step costs in bytes, and what a device holds.

Owns the tracker of live tensor bytes by category (``tracker``), byte units and budgets
(``units``, ``budget``), the CUDA caching allocator's model (``allocator``: reserved bytes from a
run's allocations), the one place that recognises an out-of-memory error (``oom``), optimizer
state sizes (``optimizer_state``), device presets (``device_specs``) and each training window's
measured peak against a budget (``window_peaks``).

May import: ``errors``, ``trees``. Nothing here knows of accumulation, checkpointing, the profile
or the planner. Invariant: every storage is counted once, by its bytes, in one category.
"""

from __future__ import annotations

from .budget import BYTES_RULE, device_free_bytes, device_memory_bytes, fraction_base_bytes, parse_bytes
from .device_specs import DeviceSpec, device_spec, devices
from .tracker import CATEGORIES, MemoryTracker
from .units import format_bytes, format_bytes_at_least

__all__ = [
    "BYTES_RULE",
    "CATEGORIES",
    "DeviceSpec",
    "MemoryTracker",
    "device_free_bytes",
    "device_memory_bytes",
    "device_spec",
    "devices",
    "format_bytes",
    "format_bytes_at_least",
    "fraction_base_bytes",
    "parse_bytes",
]
