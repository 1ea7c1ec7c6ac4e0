"""Apply: activation checkpointing per block, safe by default.

Owns ``checkpoint(model, blocks, policy)`` and its handle (``api``), finding repeated blocks
(``auto_blocks``), running one checkpointed block (``recompute``: BatchNorm statistics updated
once, caches never written twice, the same dropout masks), the selective policy (``selective``),
CPU offload (``offload``), the forms each policy takes under torch.compile (``compiled``) and the
loss head in chunks, never all logits alive at once (``head``: ``chunk_head``; ``linear_loss``).

May import: ``errors``, ``trees``, ``workload``. Never accumulation, the profile or the planner.
Invariant: a checkpointed block gives the outputs, gradients and buffers of the plain block.
"""

from __future__ import annotations

from .api import POLICIES, BlockSpec, CheckpointHandle, checkpoint, find_blocks
from .head import HeadHandle, chunk_head, chunked_cross_entropy, head_of

__all__ = [
    "POLICIES",
    "BlockSpec",
    "CheckpointHandle",
    "HeadHandle",
    "checkpoint",
    "chunk_head",
    "chunked_cross_entropy",
    "find_blocks",
    "head_of",
]
