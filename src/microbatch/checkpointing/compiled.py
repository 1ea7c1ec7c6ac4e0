"""Checkpointing and planning on models that ``torch.compile`` traces.

Eager checkpointing (api.py) relies on Python running during the recompute: a call counter
tells the first forward from the recompute, BatchNorm's running statistics are swapped for scratch
copies, and the selective policy learns which saved outputs the recompute never reaches. A compiled
backward runs none of that Python. So when dynamo traces a checkpointed block, the block takes a
compile-safe form instead, one torch's compiler understands as a whole (a ``tag_activation_checkpoint``
region whose recompute the partitioner plans):

    policy="full"       torch's checkpoint without a context_fn; the partitioner recomputes the block
    policy="selective"  saves every matmul-like output (no learned skip set); recomputes the rest
    policy="selective-half"  as eager: every second projection and the other matmul-like outputs
    policy="offload"    acts as "full": saved-tensor hooks cannot be traced, so inputs stay on device

BatchNorm needs no guard there: the compiled forward updates the running statistics once, as a
functional copy written back after the graph, and the recompute in backward only recomputes values.
Gradients equal eager's (tests/test_compile.py, aot_eager and inductor backends).

Nothing here logs while traced (a log call is a graph break); notices are given before tracing, when
a compiled model is passed in, or recorded on the handle.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

from ..trees.modules import is_compiled, unwrap_compiled
from ..workload import Workload
from .selective import HALF, MATMUL_OPS, every_second_projection

__all__ = [
    "COMPILED_FORMS",
    "COMPILED_PLAN_NOTE",
    "compiled_notice",
    "eager_workload",
    "is_compiling",
    "run_compiled",
]

# What each policy becomes in a compiled region (reported by the handle and the notice).
COMPILED_FORMS = {
    "full": "full (the compiler's partitioner plans the recompute)",
    "selective": "selective with every matmul-like output saved (no learned skip set)",
    HALF: "selective-half, as eager (every second projection saved)",
    "offload": "full (saved-tensor hooks cannot be traced; inputs stay on the device)",
}

# The planner profiles and tries the eager module inside a compiled one, and leaves compile alone.
COMPILED_PLAN_NOTE = (
    "the model is torch.compile'd: profiled and trialled eagerly (the module inside it), so the "
    "predicted peak and time are eager's (compiled training differs in both). Compile "
    "is left on: plan.apply(compiled_model, ...) checkpoints the same blocks"
)


def is_compiling() -> bool:
    """True while dynamo traces the calling code."""
    return bool(torch.compiler.is_compiling())


def compiled_notice(policies: dict[str, str]) -> str:
    """The one-line notice for blocks checkpointed on a compiled model."""
    forms = sorted(set(policies.values()))
    shown = "; ".join(f"{policy} -> {COMPILED_FORMS[policy]}" for policy in forms)
    return f"checkpointing a torch.compile'd model: in compiled code the policies act as {shown}"


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
    if getattr(op, "overloadpacket", None) in MATMUL_OPS:  # the op list of eager selective checkpointing
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


# A module-level partial: dynamo accepts a context_fn it can treat as a constant.
_SELECTIVE_CONTEXTS = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls)


def _half_contexts() -> Any:
    """selective-half's contexts for one call of a block: a fresh projection counter each call."""
    recomputed = every_second_projection()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
        if recomputed(op):
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        return _save_matmuls(ctx, op, *args, **kwargs)

    return torch_checkpoint.create_selective_checkpoint_contexts(policy)


def run_compiled(
    forward: Callable[..., Any], policy: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``forward`` checkpointed in the compile-safe form of ``policy`` (see the module doc)."""
    num_args, keyword_names = len(args), list(kwargs)

    def run(*inputs: Any) -> Any:
        return forward(*inputs[:num_args], **dict(zip(keyword_names, inputs[num_args:], strict=True)))

    if policy in ("selective", HALF):
        return torch_checkpoint.checkpoint(
            run,
            *args,
            *kwargs.values(),
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_SELECTIVE_CONTEXTS if policy == "selective" else _half_contexts,
        )
    # No context_fn argument at all: dynamo cannot trace an explicit noop_context_fn (torch 2.13).
    return torch_checkpoint.checkpoint(
        run, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True
    )


def eager_workload(workload: Workload) -> tuple[Workload, list[str]]:
    """The workload with a compiled model's eager module, and the note saying so (for the planner).

    Profiling the compiled module would recompile it for every size and policy, using up dynamo's
    recompile limit, after which training silently runs eagerly; the eager module leaves compile alone.
    """
    if not is_compiled(workload.model):
        return workload, []
    return dataclasses.replace(workload, model=unwrap_compiled(workload.model)), [COMPILED_PLAN_NOTE]
