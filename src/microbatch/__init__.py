"""microbatch: train with the batch size your recipe asks for, on the memory you have.

Exact gradient accumulation, activation checkpointing that is safe by default, and a planner
that fits a target batch into a memory budget. The architecture (data flow, each module's job,
the invariants) is in docs/design.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import distributed
from .accumulate import (
    Accumulator,
    Micro,
    TokenWindows,
    WindowStats,
    cached_backward,
    convert_batchnorm_to_groupnorm,
    schedules,
    split_by_tokens,
)
from .checkpointing import CheckpointHandle, checkpoint, find_blocks
from .errors import (
    CheckpointError,
    ConfigError,
    InfeasibleBudgetError,
    MicrobatchError,
    ResumeError,
    UsageError,
    WorkloadError,
)
from .memory import DeviceSpec, MemoryTracker, devices, format_bytes, parse_bytes
from .planner import Plan, plan
from .planner.cached_plan import CachedPlan, plan_cached
from .verification import VerifyReport, verify
from .workload import Workload, load_workload

__all__ = [
    "Accumulator",
    "CachedPlan",
    "CheckpointError",
    "CheckpointHandle",
    "ConfigError",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "MemoryTracker",
    "Micro",
    "MicrobatchError",
    "Plan",
    "ResumeError",
    "TokenWindows",
    "UsageError",
    "VerifyReport",
    "WindowStats",
    "Workload",
    "WorkloadError",
    "__version__",
    "cached_backward",
    "checkpoint",
    "convert_batchnorm_to_groupnorm",
    "devices",
    "distributed",
    "find_blocks",
    "format_bytes",
    "load_workload",
    "parse_bytes",
    "plan",
    "plan_cached",
    "schedules",
    "split_by_tokens",
    "verify",
]
