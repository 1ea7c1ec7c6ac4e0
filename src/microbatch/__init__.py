"""microbatch: train with the batch size your recipe asks for, on the memory you have.

Exact gradient accumulation, activation checkpointing that is safe by default, and a planner
that fits a target batch into a memory budget. The architecture (data flow, each module's job,
the invariants) is in docs/design.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import distributed, schedules
from .accumulate import Accumulator, Micro, WindowStats
from .batchnorm import convert_batchnorm_to_groupnorm, corrected_momentum
from .cached import cached_backward
from .checkpoint import CheckpointHandle, checkpoint, find_blocks
from .devices import DeviceSpec, devices
from .errors import (
    CheckpointError,
    ConfigError,
    InfeasibleBudgetError,
    MicrobatchError,
    ResumeError,
    UsageError,
    WorkloadError,
)
from .memory import MemoryTracker, format_bytes, parse_bytes
from .planner import FrontierPoint, Plan, plan
from .planner.cached import CachedPlan, plan_cached
from .profile import Profile, profile_workload
from .tokens import TokenStats, TokenWindows, split_by_tokens
from .verify import VerifyReport, verify
from .workload import Workload, load_workload

__all__ = [
    "Accumulator",
    "CachedPlan",
    "CheckpointError",
    "CheckpointHandle",
    "ConfigError",
    "DeviceSpec",
    "FrontierPoint",
    "InfeasibleBudgetError",
    "MemoryTracker",
    "Micro",
    "MicrobatchError",
    "Plan",
    "Profile",
    "ResumeError",
    "TokenStats",
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
    "corrected_momentum",
    "devices",
    "distributed",
    "find_blocks",
    "format_bytes",
    "load_workload",
    "parse_bytes",
    "plan",
    "plan_cached",
    "profile_workload",
    "schedules",
    "split_by_tokens",
    "verify",
]
