"""microbatch: train with the batch size your recipe asks for, on the memory you have.

Exact gradient accumulation, activation checkpointing that is safe by default, and a planner
that fits a target batch into a memory budget. See DESIGN.md for the contract.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .accumulate import Accumulator, Micro, WindowStats
from .batchnorm import convert_batchnorm_to_groupnorm, corrected_momentum
from .errors import MicrobatchError
from .workload import Workload, load_workload

__all__ = [
    "Accumulator",
    "MicrobatchError",
    "Micro",
    "WindowStats",
    "convert_batchnorm_to_groupnorm",
    "corrected_momentum",
    "Workload",
    "__version__",
    "load_workload",
]
