"""The gradient arithmetic of ``Accumulator.step``, and how it is undone when the optimizer raises.

The backwards left items_ri / R * grad(loss_ri) in .grad (accumulator.py's docstring), so one multiply
by factor = R * W_avg / T makes it the full batch's gradient. Clipping multiplies by
clip = min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s coefficient); both are
applied as one multiply, factor * clip, just before the optimizer step. Gradients summed in a wide
dtype (precision.py) are normalised there by factor already, and get only clip.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from .. import distributed
from ..errors import ConfigError
from ..stepping.step_guard import guarded_optimizer_step, require_items
from .state import WindowState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scaled:
    """What scale_gradients changed, so restore_gradients can change it back."""

    grads: list[torch.Tensor]  # multiplied by multiplier
    multiplier: float  # factor * clip
    wide: list[nn.Parameter]  # gradients from the wide sums, multiplied by clip only
    clip: float
    factor: float
    grad_norm: float  # before clipping
    skipped: bool  # the norm is not finite: no optimizer step


def read_window(state: WindowState) -> tuple[float, float, float]:
    """This rank's items, loss sum and R as numbers: one read from the device per window."""
    values = [state.items, state.loss_sum, state.reference_items]
    flags = state.item_flags  # kept until the read succeeds, so a retried step() checks them too
    on_device = [v for v in (*values, flags) if isinstance(v, torch.Tensor)]
    if not on_device:
        return float(values[0]), float(values[1]), float(values[2])
    device = on_device[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    read = iter(torch.cat([v.to(device=device, dtype=dtype).reshape(-1) for v in on_device]).cpu().tolist())
    numbers = [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
    bad, empty = (next(read), next(read)) if flags is not None else (0.0, 0.0)
    if bad or empty:
        state.discard()  # gradients, wide sums and counts: the next window starts clean
        raise ConfigError(
            f"window {state.window}: "
            + (
                "an items count was negative, not finite or not a whole number"
                if bad
                else "a micro-batch with items=0 had a non-finite loss (0/0: no predicted tokens)"
            )
            + "; the window's gradients are discarded. Drop such micro-batches from the data"
        )
    state.item_flags = None
    return numbers[0], numbers[1], numbers[2]


def agree_on_totals(
    state: WindowState, items: float, loss_sum: float, *, data_parallel: bool
) -> tuple[float, float, float, int]:
    """(T, loss sum, micro-batches) over all ranks, and W_avg; sets how many ranks have more data."""
    local = [items, loss_sum, float(state.micro_batches), float(state.has_more_local)]
    averaged_over = 1
    if data_parallel:
        # One all_reduce per window: global items T, loss sum, micro-batches, ranks with more data.
        local = distributed.all_reduce_values(local)
        averaged_over = distributed.world_size()  # DDP and FSDP2 divide the summed gradient by W
    total_items, total_loss, total_micro_batches, state.ranks_with_more = local
    require_items(total_items, "step()")
    return total_items, total_loss, total_micro_batches, averaged_over


def total_norm(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    norm = nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor norm
        norm = norm.full_tensor()
    return float(norm)


def scale_gradients(
    state: WindowState,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    factor: float,
) -> Scaled:
    """Unscale (GradScaler, once), normalise by ``factor`` and clip the optimizer's gradients.

    If this raises (out of memory computing the norm), the gradients are partly scaled: the
    window can only be dropped (``state.progress.scaling_failed``; step() refuses a retry), and
    the scaler forgets the unscale so the next window may unscale again. Nothing was stepped.
    """
    try:
        return _scale_gradients(state, optimizer, scaler, max_grad_norm, factor)
    except BaseException:
        state.progress.scaling_failed = True
        if scaler is not None:
            scaler._per_optimizer_states.pop(id(optimizer), None)
        raise


def _scale_gradients(
    state: WindowState,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    factor: float,
) -> Scaled:
    widened = state.wide.restore_(factor) if state.wide is not None else set()  # scaled in the wide dtype
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if scaler is not None:
        scaler.unscale_(optimizer)  # the optimizer's gradients only, at most once a window
    grads = [p.grad for p in stepped if id(p) not in widened]
    wide = [p for p in stepped if id(p) in widened]
    # Normalising multiplies the other gradients by factor (the wide ones are already), so the
    # total norm is sqrt((factor * |others|)^2 + |wide|^2).
    grad_norm = math.hypot(factor * total_norm(grads), total_norm([p.grad for p in wide]))
    skipped = not math.isfinite(grad_norm)
    clip = 1.0
    if max_grad_norm is not None and not skipped:
        # torch.nn.utils.clip_grad_norm_'s coefficient, applied in the same multiply.
        clip = min(1.0, max_grad_norm / (grad_norm + 1e-6))
    multiplier = factor * clip
    if grads and multiplier != 1.0:
        torch._foreach_mul_(grads, multiplier)
    wide_grads = [p.grad for p in wide if p.grad is not None]
    if wide_grads and clip != 1.0:
        torch._foreach_mul_(wide_grads, clip)
    return Scaled(grads, multiplier, wide, clip, factor, grad_norm, skipped)


def restore_gradients(
    state: WindowState, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, scaled: Scaled
) -> None:
    """Undo scale_gradients after the optimizer raised: the window's gradients as before step()."""
    grads, wide, clip = scaled.grads, scaled.wide, scaled.clip
    if grads and scaled.multiplier != 1.0:
        torch._foreach_div_(grads, scaled.multiplier)  # within one rounding of the gradients before
    wide_grads = [p.grad for p in wide if p.grad is not None]
    if wide_grads and clip != 1.0:
        torch._foreach_div_(wide_grads, clip)
    if scaler is not None:
        scale = scaler.get_scale()
        everything = grads + wide_grads
        if everything and scale != 1.0:
            torch._foreach_mul_(everything, scale)  # a power of two: exactly undoes unscale_
        # Forget that unscale_ ran for this optimizer, so a retried step() may call it again.
        scaler._per_optimizer_states.pop(id(optimizer), None)
    if state.wide is not None:
        for p in wide:  # back into the wide sums, unnormalised, as before restore_()
            if p.grad is not None:
                state.wide.sums[id(p)] = p.grad.to(state.wide.dtype) / scaled.factor
            p.grad = None


def optimizer_step(
    state: WindowState, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, scaled: Scaled
) -> None:
    """The optimizer step (skipped on a non-finite norm), undone with restore_gradients if it raises.

    Whether the optimizer had changed anything before it raised is read from version counters
    (stepping.step_guard.guarded_optimizer_step): a clean failure may be retried, a half-made step
    may not (step() then refuses it).
    """

    def run() -> None:
        if scaler is not None:
            scaler.step(optimizer)  # skips by itself when unscale_ found inf/nan
        elif not scaled.skipped:
            optimizer.step()
        else:
            logger.warning(
                "window %d: non-finite gradient norm (%s); optimizer step skipped",
                state.window,
                scaled.grad_norm,
            )

    try:
        guarded_optimizer_step(
            state.progress,
            optimizer,
            run,
            on_raise=lambda: restore_gradients(state, optimizer, scaler, scaled),
        )
    except BaseException:
        logger.warning(
            "window %d: the optimizer step raised; %s",
            state.window,
            "it had already changed parameters or optimizer state, so step() will not be retried: restore "
            "model and optimizer from a checkpoint, then discard_window()"
            if state.progress.mutated
            else "it had changed nothing and the window's gradients are restored, so step() can be retried "
            "or the window dropped with discard_window()",
        )
        raise
