"""Per-block cost measurement: everything the planner knows about a model.

The model runs forward and backward at two or three micro-batch sizes, once under each checkpoint
policy applied to every block (``mb.checkpoint``, same block discovery). Hooks split each run into
segments in forward order: the part before the first block (embeddings), each block, the gaps
between blocks, and the part after the last block (head and loss). For each segment:

    forward_seconds, backward_seconds   medians over timed runs (warm-up excluded); the backward of
                                        a checkpointed block includes its recompute
    kept_bytes      live bytes at the segment's forward end minus at its forward start: what autograd
                    saved (each storage once), the boundary a checkpoint keeps, the output
    peak_bytes      the most live bytes while the segment runs forward or backward, minus the live
                    bytes at its forward start (a recomputed block's activations count here)
    boundary_bytes  the block's input (what a checkpoint keeps)

Each is fitted as a + k * b over the sizes (``Fit``); a fit that misses a measurement by more than
10 % is reported as not linear. Live bytes are counted the way MemoryTracker counts them (the same
tracker, read at the hooks), so the planner's predicted peak and the trial's measured peak agree.

Static memory comes from the real optimizer after a real step: parameters, gradients and the
optimizer's state (MemoryTracker's breakdown). The model's parameters, buffers and RNG state are
restored afterwards: profiling trains nothing.
"""

from __future__ import annotations

from .costs import NONE, Fit, PolicyCost, Profile, SegmentProfile
from .measure import (
    ProgressFn,
    default_micro_batch_sizes,
    default_policies,
    free_memory,
    is_out_of_memory,
    preserved_state,
    profile_workload,
)

__all__ = [
    "NONE",
    "Fit",
    "PolicyCost",
    "Profile",
    "ProgressFn",
    "SegmentProfile",
    "default_micro_batch_sizes",
    "default_policies",
    "free_memory",
    "is_out_of_memory",
    "preserved_state",
    "profile_workload",
]
