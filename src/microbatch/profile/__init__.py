"""Per-block cost measurement: everything the planner knows about a model.

The model runs forward and backward at up to three micro-batch sizes (1, and half and all of the
largest asked), under each checkpoint policy applied to every block (``mb.checkpoint``, the same
block discovery). Hooks split each run into segments in forward order: the part before the first
block (embeddings), each block, the gaps between blocks, and the part after the last block (head
and loss). For each segment and policy:

    kept_bytes      live bytes at the segment's forward end minus at its forward start: what autograd
                    saved (each storage once), what a checkpoint holds, the output
    peak_bytes      the most live bytes while the segment runs forward or backward, minus the live
                    bytes at its forward start (a recomputed block's activations live again here)
    forward_seconds, backward_seconds   from the fastest timed round (assemble.fastest_runs); a
                    checkpointed block's backward includes its recompute
    boundary_bytes  the block's input

Live bytes are read from a MemoryTracker at the hooks: the same counting as the planner's trial,
so predicted and measured peaks agree. The runs go through Accumulator.backward with every
gradient allocated, as from a window's second micro-batch on. Bytes are measured under a fresh
checkpoint on its first call and again in the steady state after it (a selective checkpoint
learns what to skip in its first recompute). Times are taken in rounds that visit every
(policy, size) in turn, so a slow moment of a shared machine hits all of them alike.

Fits over the sizes (``Fit``): bytes are interpolated piecewise linearly (a convex maximum over
moments of lines in b, which chords over-estimate), times through the measurements and beyond
them along the least-squares slope k >= 0 of a + k * b (Fit.line_beyond). A fit whose line misses
a measurement by more than 10 % is reported as not linear.

Static memory comes from the real optimizer after a real step: parameters, gradients and the
optimizer's state (MemoryTracker's breakdown). Parameters, gradients, buffers, modes and the RNG
are restored afterwards: profiling trains nothing.

May import: ``errors``, ``trees``, ``memory``, ``workload``, ``distributed``, ``accumulate``,
``checkpointing``; never the planner, which reads only the Profile this package returns.
"""

from __future__ import annotations

from ..memory.oom import free_memory, is_out_of_memory
from .costs import NONE, Fit, PolicyCost, Profile, SegmentProfile
from .measure import ProgressFn, default_micro_batch_sizes, default_policies, profile_workload
from .runs import preserved_state

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
