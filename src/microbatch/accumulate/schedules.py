"""Schedules that follow from a changed effective batch: accumulation, weight decay, learning rate.

Nominal batch (Ultralytics). A recipe tuned for a nominal batch ``nbs`` (64 in Ultralytics) keeps
its hyperparameters on a smaller device batch ``b`` by accumulating

    accumulate = max(round(nbs / b), 1)

micro-batches per optimizer step. During the first ``nw`` micro-batches (the warmup) the count ramps
up from 1 by linear interpolation,

    accumulate(i) = max(1, round(interp(i, [0, nw], [1, nbs / b]))),

and weight decay, which a summed loss applies once per optimizer step to a batch of b * accumulate
samples, is scaled to the nominal batch as

    weight_decay' = weight_decay * b * accumulate / nbs.

Rounding is Python's (and NumPy's) round-half-to-even, as in Ultralytics: nbs / b = 2.5 gives 2.

Learning rate for a changed effective batch. Going from a base batch B0 to B multiplies the
learning rate by k = B / B0 (linear rule, Goyal et al. 2017, "Accurate, Large Minibatch SGD") or
by sqrt(B / B0) (square-root rule, common for Adam). Goyal et al. reach the scaled rate by a
gradual warmup: start at the base rate and add a constant amount per step until k times the base
rate is reached (5 epochs for ResNet-50 on ImageNet at B = 8192).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from ..errors import ConfigError

LRRule = Literal["linear", "sqrt"]
LR_RULES: tuple[str, ...] = ("linear", "sqrt")

ULTRALYTICS_NOMINAL_BATCH = 64
ULTRALYTICS_MIN_WARMUP_ITERATIONS = 100


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _non_negative_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _interp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    """numpy.interp on one segment: y0 left of x0, y1 right of x1, linear in between.

    Same arithmetic as NumPy (slope * (x - x0) + y0), so values that round at .5 agree with it.
    """
    if x <= x0:
        return y0
    if x >= x1:
        return y1
    slope = (y1 - y0) / (x1 - x0)
    return slope * (x - x0) + y0


# ---------------------------------------------------------------------- nominal batch (Ultralytics)


def nominal_accumulation(batch: int, *, nominal_batch: int = ULTRALYTICS_NOMINAL_BATCH) -> int:
    """Micro-batches per optimizer step so ``batch`` acts like ``nominal_batch``: max(round(nbs / b), 1).

    batch=16 -> 4 and batch=8 -> 8 with the default nominal batch of 64.
    """
    _positive_int(batch, "batch")
    _positive_int(nominal_batch, "nominal_batch")
    return max(round(nominal_batch / batch), 1)


def warmup_accumulation(
    iteration: int,
    *,
    batch: int,
    warmup_iterations: int,
    nominal_batch: int = ULTRALYTICS_NOMINAL_BATCH,
) -> int:
    """Accumulation count at micro-batch ``iteration`` (counted from 0 over the whole run).

    Ramps from 1 at iteration 0 to nbs / b at ``warmup_iterations`` (interpolated, then rounded),
    and is ``nominal_accumulation(batch)`` from there on.
    """
    _non_negative_int(iteration, "iteration")
    _positive_int(batch, "batch")
    _non_negative_int(warmup_iterations, "warmup_iterations")
    _positive_int(nominal_batch, "nominal_batch")
    if iteration >= warmup_iterations:
        return nominal_accumulation(batch, nominal_batch=nominal_batch)
    ramp = _interp(iteration, 0, warmup_iterations, 1.0, nominal_batch / batch)
    return max(1, round(ramp))


def warmup_iterations_for(
    warmup_epochs: float,
    *,
    batches_per_epoch: int,
    minimum: int = ULTRALYTICS_MIN_WARMUP_ITERATIONS,
) -> int:
    """Ultralytics' warmup length in micro-batches: max(round(warmup_epochs * batches_per_epoch), 100)."""
    if not (warmup_epochs >= 0 and math.isfinite(warmup_epochs)):
        raise ConfigError(f"warmup_epochs must be a finite number >= 0, got {warmup_epochs!r}")
    _positive_int(batches_per_epoch, "batches_per_epoch")
    _non_negative_int(minimum, "minimum")
    return max(round(warmup_epochs * batches_per_epoch), minimum)


def accumulation_schedule(
    *,
    batch: int,
    warmup_iterations: int = 0,
    nominal_batch: int = ULTRALYTICS_NOMINAL_BATCH,
) -> Callable[[int], int]:
    """``window -> micro-batches`` for ``Accumulator(steps=...)``, following Ultralytics' warmup.

    Ultralytics counts micro-batches i and steps the optimizer once ``i - last_step >= accumulate(i)``.
    A window that starts at micro-batch s therefore holds the smallest L >= 1 with
    L >= warmup_accumulation(s + L - 1). The window starts are cumulative sums of the lengths before
    them, so the function is pure in ``window`` (resuming at any window gives the same lengths).
    """
    _positive_int(batch, "batch")
    _non_negative_int(warmup_iterations, "warmup_iterations")
    _positive_int(nominal_batch, "nominal_batch")
    final = nominal_accumulation(batch, nominal_batch=nominal_batch)
    lengths: list[int] = []  # lengths[w] for the windows that start inside the warmup
    starts: list[int] = [0]  # starts[w]: first micro-batch of window w

    def window_length(start: int) -> int:
        length = 1
        while length < warmup_accumulation(
            start + length - 1, batch=batch, warmup_iterations=warmup_iterations, nominal_batch=nominal_batch
        ):
            length += 1
        return length

    def steps(window: int) -> int:
        _non_negative_int(window, "window")
        while len(lengths) <= window and starts[-1] < warmup_iterations:
            lengths.append(window_length(starts[-1]))
            starts.append(starts[-1] + lengths[-1])
        if window < len(lengths):
            return lengths[window]
        return final  # every later window starts after the warmup

    return steps


def scaled_weight_decay(
    weight_decay: float,
    *,
    batch: int,
    accumulation: int,
    nominal_batch: int = ULTRALYTICS_NOMINAL_BATCH,
) -> float:
    """Weight decay for an optimizer step over ``batch * accumulation`` samples: wd * b * acc / nbs."""
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ConfigError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    _positive_int(batch, "batch")
    _positive_int(accumulation, "accumulation")
    _positive_int(nominal_batch, "nominal_batch")
    return weight_decay * batch * accumulation / nominal_batch


# ---------------------------------------------------------------------- learning rate


def lr_scale_factor(*, base_batch: int, batch: int, rule: LRRule = "linear") -> float:
    """k = B / B0 (linear) or sqrt(B / B0) (square root)."""
    _positive_int(base_batch, "base_batch")
    _positive_int(batch, "batch")
    if rule == "linear":
        return batch / base_batch
    if rule == "sqrt":
        return math.sqrt(batch / base_batch)
    raise ConfigError(f"rule must be one of {', '.join(LR_RULES)}, got {rule!r}")


def scale_lr(base_lr: float, *, base_batch: int, batch: int, rule: LRRule = "linear") -> float:
    """The learning rate for effective batch ``batch`` when ``base_lr`` was tuned at ``base_batch``."""
    if not (base_lr >= 0 and math.isfinite(base_lr)):
        raise ConfigError(f"base_lr must be a finite number >= 0, got {base_lr!r}")
    return base_lr * lr_scale_factor(base_batch=base_batch, batch=batch, rule=rule)


def warmup_lr(step: int, *, lr: float, warmup_steps: int, start_lr: float = 0.0) -> float:
    """Linear warmup: ``start_lr`` at optimizer step 0, ``lr`` from ``warmup_steps`` on.

    Goyal et al. start at the base (unscaled) rate: ``start_lr=base_lr``, ``lr=scale_lr(base_lr, ...)``.
    """
    _non_negative_int(step, "step")
    _non_negative_int(warmup_steps, "warmup_steps")
    for name, value in (("lr", lr), ("start_lr", start_lr)):
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if warmup_steps == 0:
        return lr
    return _interp(step, 0, warmup_steps, start_lr, lr)


def lr_multiplier(
    *, base_batch: int, batch: int, rule: LRRule = "linear", warmup_steps: int = 0
) -> Callable[[int], float]:
    """``step -> factor`` for ``torch.optim.lr_scheduler.LambdaLR`` on an optimizer set to the base rate.

    The factor rises linearly from 1 (the base rate) at step 0 to k at ``warmup_steps`` and stays at
    k (Goyal et al.'s gradual warmup). With the Accumulator the scheduler steps once per optimizer
    step, so ``warmup_steps`` counts optimizer steps.
    """
    factor = lr_scale_factor(base_batch=base_batch, batch=batch, rule=rule)
    _non_negative_int(warmup_steps, "warmup_steps")

    def multiplier(step: int) -> float:
        return warmup_lr(step, lr=factor, warmup_steps=warmup_steps, start_lr=1.0)

    return multiplier
