"""What ``Plan.apply`` checks and builds: the model inside a data-parallel wrapper, and the
Accumulator options that change memory, held to what the plan was made with.

Options that allocate are plan inputs (``mb.plan(..., accumulate_dtype=..., scaler=True,
max_grad_norm=1.0)``): the
profile and the trial ran with them, so the plan's peak holds only with them. ``apply`` therefore

- takes ``accumulate_dtype`` and the FSDP sync mode from the plan when they are not given, and
  refuses a different value, naming it;
- takes ``max_grad_norm`` (clipping's norm temporaries) from the plan and refuses a different one;
- refuses a GradScaler when the plan was made without one (its scale and found-inf tensors, and the
  unscale's work, were not measured).

The wrapper: DDP keeps the model in ``.module`` (its parameter and module names carry ``module.``);
a torch.compile'd model keeps it in ``_orig_mod``. The plan's blocks are checkpointed in the model
inside, while the Accumulator gets the wrapper, so that DDP's ``no_sync`` and FSDP2's gradient sync
flag are used. FSDP2's ``fully_shard`` changes no names: the model is its own inner model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...accumulate.accumulator import Accumulator
from ...checkpointing.api import CheckpointHandle
from ...checkpointing.head import chunk_head
from ...errors import ConfigError
from ...trees.modules import unwrap_compiled

GRADIENT_SYNCS = ("window", "micro-batch")
# The optimizer step's implementations (planner/levers/step_choice.py): the same update, other temporaries.
STEP_IMPLEMENTATIONS = ("foreach", "fused", "per-tensor")
_FLAGS = {"foreach": (True, False), "fused": (False, True), "per-tensor": (False, False)}
_APPLIED = "_microbatch_applied_plan"  # on the inner model: (checkpoint handle, weakref to the Accumulator)


def attach(
    model: nn.Module,
    checkpoint: Callable[[nn.Module], CheckpointHandle | None],
    optimizer: torch.optim.Optimizer,
    steps: int,
    options: dict[str, Any],
    *,
    head_chunk_tokens: int | None = None,
    optimizer_step: str | None = None,
) -> Accumulator:
    """Checkpoint the module inside ``model`` and build the Accumulator on ``model`` itself; chunk its
    loss head and set the optimizer's step implementation when the plan chose them."""
    inner = inner_model(model)
    if _APPLIED in inner.__dict__:
        raise ConfigError(
            "plan.apply(model, ...): this model already has a plan applied; call plan.remove(model) "
            "first, then apply the new plan"
        )
    if optimizer_step is not None:
        set_step_(optimizer, optimizer_step)  # the same update; not undone by remove()
    handle = checkpoint(inner)
    head = chunk_head(inner, tokens=head_chunk_tokens) if head_chunk_tokens is not None else None
    try:
        accumulator = Accumulator(model, optimizer, steps=steps, **options)
    except BaseException:
        for undo in (handle, head):
            if undo is not None:
                undo.remove()
        raise
    inner.__dict__[_APPLIED] = (handle, weakref.ref(accumulator), head)
    return accumulator


def detach(model: nn.Module) -> None:
    """Undo ``attach``: the checkpointing removed, the Accumulator closed; nothing when none is attached."""
    applied = inner_model(model).__dict__.pop(_APPLIED, None)
    if applied is not None:
        handle, accumulator, head = applied
        for undo in (handle, head):
            if undo is not None:
                undo.remove()
        if (closing := accumulator()) is not None:
            closing.close()


def inner_model(model: nn.Module) -> nn.Module:
    """The module whose blocks the plan names: inside torch.compile and DDP."""
    model = unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = unwrap_compiled(model.module)
    return model


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float32`` -> "float32" (what a saved plan holds)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def accumulator_options(
    *,
    accumulate_dtype: str | None,
    scaler: bool,
    gradient_sync: str,
    given: dict[str, Any],
    max_grad_norm: float | None = None,
) -> dict[str, Any]:
    """``given`` with the plan's memory-changing options filled in; ConfigError on a mismatch."""
    options = dict(given)
    wanted = dtype_name(options.get("accumulate_dtype"))
    if "accumulate_dtype" in options and wanted != accumulate_dtype:
        raise ConfigError(
            f"plan.apply(accumulate_dtype={wanted}): the plan was made with "
            f"accumulate_dtype={accumulate_dtype} and its peak holds only so; make the plan with "
            "mb.plan(..., accumulate_dtype=...) or leave it out"
        )
    if accumulate_dtype is not None:
        options["accumulate_dtype"] = getattr(torch, accumulate_dtype)
    if options.get("scaler") is not None and not scaler:
        raise ConfigError(
            "plan.apply(scaler=...): the plan was made without a GradScaler, whose tensors and unscale it "
            "did not measure; make the plan with mb.plan(..., scaler=True)"
        )
    if "max_grad_norm" in options and options["max_grad_norm"] != max_grad_norm:
        raise ConfigError(
            f"plan.apply(max_grad_norm={options['max_grad_norm']}): the plan was made with "
            f"max_grad_norm={max_grad_norm} and its peak holds only so; make the plan with "
            "mb.plan(..., max_grad_norm=...) or leave it out (apply sets it)"
        )
    options["max_grad_norm"] = max_grad_norm
    every = gradient_sync == "micro-batch"
    if "sync_every_micro_batch" in options and bool(options["sync_every_micro_batch"]) != every:
        raise ConfigError(
            f"plan.apply(sync_every_micro_batch={options['sync_every_micro_batch']}): the plan chose "
            f"gradient_sync={gradient_sync!r} and its peak holds only so; leave sync_every_micro_batch out "
            "(apply sets it), or make the plan with mb.plan(..., gradient_sync=...)"
        )
    options["sync_every_micro_batch"] = every
    return options


def supported_steps(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The implementations ``optimizer``'s class offers (none for an optimizer without ``foreach``)."""
    defaults = optimizer.defaults
    if "foreach" not in defaults:
        return ()
    return tuple(name for name in STEP_IMPLEMENTATIONS if name != "fused" or "fused" in defaults)


def set_step_(optimizer: torch.optim.Optimizer, implementation: str) -> torch.optim.Optimizer:
    """Make ``optimizer`` step with ``implementation`` (every param group); ConfigError if it has none."""
    if implementation not in STEP_IMPLEMENTATIONS:
        raise ConfigError(
            f"optimizer_step={implementation!r} is no step implementation; choose from "
            f"{', '.join(STEP_IMPLEMENTATIONS)}"
        )
    if implementation not in supported_steps(optimizer):
        raise ConfigError(
            f"{type(optimizer).__name__} has no {implementation} step (it offers "
            f"{', '.join(supported_steps(optimizer)) or 'no choice'}); plan with its own step"
        )
    foreach, fused = _FLAGS[implementation]
    for group in optimizer.param_groups:
        group["foreach"] = foreach
        if "fused" in optimizer.defaults:
            group["fused"] = fused
    if fused:
        for state in optimizer.state.values():  # a fused step keeps its step counts as float32 on the device
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                held = next(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
                state["step"] = step.to(held.device, torch.float32)
    return optimizer
