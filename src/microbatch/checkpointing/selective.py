"""The selective checkpoint policy: save the outputs of matmul-like ops, recompute the cheap ops.

Every op that FlopCounterMode counts is in MATMUL_OPS, so a selective recompute adds no FLOPs; it
reruns only elementwise ops, norms and the like. compiled.py uses the same op list in its
compile-safe form of the policy.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MATMUL_OPS", "OpKey", "SelectivePlan"]

# Matmul-like aten ops whose outputs the selective policy saves (everything else is recomputed).
# These are all the ops FlopCounterMode counts, so selective recomputation adds no FLOPs.
_MATMUL_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
MATMUL_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in _MATMUL_OP_NAMES if hasattr(torch.ops.aten, name)
)


OpKey = tuple[Any, int]  # (aten op, how many times the block ran it before) within one forward


class _OpsReached(TorchDispatchMode):
    """Records which ops a recompute reaches (torch stops it once every saved tensor is back)."""

    def __init__(self, reached: set[OpKey]) -> None:
        super().__init__()
        self.reached = reached
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.reached.add((func, self.counts[func]))
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


class SelectivePlan:
    """Which matmul-like outputs one block's selective checkpoint saves.

    Every matmul output is saved, except those a recompute never needed: with early stopping, the
    recompute ends at the block's last saved tensor, so a final matmul whose output nothing inside
    the block saves (a projection feeding a residual add) is never rerun, and caching its output
    would only cost memory. Each recompute teaches the plan which saved outputs it did not reach;
    a skipped op that a later recompute does reach is saved again. Correct either way: an op not
    saved is recomputed.
    """

    # Recording costs a Python dispatch per recomputed op; stop once the plan has held this long.
    STABLE_AFTER = 2

    def __init__(self) -> None:
        self.skip: frozenset[OpKey] = frozenset()
        self.unchanged = 0  # recomputes in a row that left the plan as it was

    def contexts(self, saved: set[OpKey], reached: set[OpKey]) -> tuple[Any, Any]:
        counts: dict[Any, int] = defaultdict(int)
        skip = self.skip

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
            key = (op, counts[op])
            counts[op] += 1
            if getattr(op, "overloadpacket", None) in MATMUL_OPS and key not in skip:
                saved.add(key)
                return torch_checkpoint.CheckpointPolicy.MUST_SAVE
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(policy)
        if self.unchanged >= self.STABLE_AFTER:
            return caching, cached

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with cached, _OpsReached(reached):  # the recorder sees each op before the cache answers it
                yield

        return caching, recompute()

    def learn(self, saved: set[OpKey], reached: set[OpKey]) -> None:
        if not reached:  # not recorded (plan stable), or a recompute that ran nothing
            return
        skip = frozenset((self.skip | saved) - reached)
        self.unchanged = self.unchanged + 1 if skip == self.skip else 0
        self.skip = skip
