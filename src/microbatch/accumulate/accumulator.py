"""Exact gradient accumulation: the window gradient equals the full batch's.

For a window of micro-batches i (on every rank r) whose losses are means over items_ri items
(samples, or tokens that are not padding), the full batch's mean loss is

    L = sum_ri(items_ri * loss_ri) / T,        T = sum_ri(items_ri)

so its gradient is sum_ri(items_ri * grad(loss_ri)) / T. The window is not fetched ahead of time,
so T is unknown while the backwards run. Each backward therefore adds items_ri / R * grad(loss_ri)
into .grad, where R is a reference count fixed at the window's first backward (an estimate of the
per-rank window total, so the weighted loss keeps the magnitude of a plain mean: safe for fp16 and
GradScaler). At step(), once T is known (summed over ranks in one all_reduce), the gradients are
multiplied once by R * W_avg / T, where W_avg is the world size when DDP / FSDP2 averaged the
gradients over ranks (and 1 otherwise). The result is exact up to one rounding per element.

Across data-parallel ranks (DDP, FSDP2) every rank must run the same number of micro-batches per
window, or the gradient collectives would pair up wrongly or hang. iterate() agrees on each window's
length: after every micro-batch but a window's last, one all_reduce of one number (how many ranks
have another micro-batch); at the window's last, that number rides in step()'s all_reduce. A rank
whose data runs out first repeats its last micro-batch with weight 0 (Micro.is_padding) until the
others finish, so every collective is matched and the gradient stays exact.

Order inside step(), which is what the full-batch step would do:
GradScaler unscale (once) -> normalise -> clip (once, on the accumulated gradient) ->
optimizer step (skipped on a non-finite gradient) -> scheduler step (only when the optimizer
stepped) -> zero_grad(set_to_none=True). Normalising and clipping act on the optimizer's parameters
(the ones GradScaler unscales), as one multiply made just before the optimizer step; if the step
raises, it is undone (and the scaler's unscale forgotten), so the window can be retried exactly or
dropped with discard_window().
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..errors import ConfigError, UsageError
from ..trees.batches import batch_size_of
from .batchnorm import batchnorm_layers, corrected_momentum
from .foreign import refuse_foreign_accumulation
from .iteration import iterate_windows
from .micro import (
    Micro,
    WindowStats,
    check_loss,
    learning_rate,
    tensor_item_flags,
    validate_items,
    validate_steps_value,
)
from .precision import WideGradients
from .window import optimizer_step, read_window, scale_gradients

logger = logging.getLogger(__name__)

__all__ = ["Accumulator", "Micro", "StepsSchedule", "WindowStats"]

StepsSchedule = int | Sequence[int] | Callable[[int], int]


class Accumulator:
    """Gradient accumulation whose window gradient equals the full-batch gradient.

    ``steps`` is the number of micro-batches per optimizer step: an int, a sequence (one entry per
    window; the last entry repeats), or a callable ``window_index -> steps`` (accumulation warmup).
    ``scheduler`` steps once per optimizer step that was taken; ``max_grad_norm`` clips once, on the
    accumulated and unscaled gradient; ``scaler`` (torch.amp.GradScaler) scales each backward and
    unscales once per window. For data parallelism pass the wrapped model (the
    DistributedDataParallel module itself, or the fully_shard root): gradient sync then runs only on
    a window's last micro-batch, or on every one with ``sync_every_micro_batch`` (less memory, more
    communication). ``correct_batchnorm_momentum`` sets each
    BatchNorm's momentum so a window of N micro-batches decays its running statistics like one update.
    ``accumulate_dtype`` (e.g. torch.float32) sums low-precision parameters' gradients in that dtype
    across the window and rounds once at ``step()`` (see precision.py; single process only).
    """

    # Window state, reset by _reset_window() after every step(). Counts given as device tensors stay
    # tensors until step() reads them, once per window.
    _items: float | torch.Tensor
    _loss_sum: torch.Tensor | float
    _micro_batches: int
    _reference_items: float | torch.Tensor
    _item_flags: torch.Tensor | None  # see micro.tensor_item_flags
    _awaiting_step: bool
    _current: Micro | None

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        steps: StepsSchedule = 1,
        *,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        sync_every_micro_batch: bool = False,
        correct_batchnorm_momentum: bool = False,
        accumulate_dtype: torch.dtype | None = None,
    ) -> None:
        _check_options(model, optimizer, steps, max_grad_norm)
        refuse_foreign_accumulation(optimizer)  # Accelerate's own accumulation would drop our steps
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.sync_every_micro_batch = sync_every_micro_batch
        self._steps = steps
        self._data_parallel = distributed.data_parallel_kind(model)
        if self._data_parallel is None and distributed.world_size() > 1:
            distributed.log_rank_zero(
                logger,
                logging.WARNING,
                "torch.distributed runs %d ranks but the model given to Accumulator is neither "
                "DistributedDataParallel nor sharded with fully_shard: gradients and item counts stay "
                "local to each rank. Pass the wrapped model (the DDP module itself).",
                distributed.world_size(),
            )

        # Every parameter whose gradient this accumulator clears at step(); it normalises and clips
        # exactly the optimizer's parameters: those are the ones GradScaler unscales.
        self._params = _parameters(model, optimizer)
        if accumulate_dtype is not None and self._data_parallel is not None:
            raise ConfigError(
                "accumulate_dtype with DDP / FSDP is not supported: their gradient hooks read .grad, which "
                "a wide accumulation empties between micro-batches; leave accumulate_dtype=None"
            )
        # Low-precision parameters' gradients summed in accumulate_dtype (precision.py).
        self._wide = WideGradients(self._params, accumulate_dtype) if accumulate_dtype is not None else None

        self._batchnorm = batchnorm_layers(model)
        self._batchnorm_momentum = {name: layer.momentum for name, layer in self._batchnorm}
        self._correct_batchnorm = correct_batchnorm_momentum
        self._warned_batchnorm = False
        self._set_batchnorm_momentum(0)  # for a manual backward()/step() loop too, not only iterate()

        self.window = 0  # index of the window in progress (= optimizer steps taken or skipped)
        self._items_per_micro: float | None = None  # running estimate, for the reference count R
        self._has_more_local = False  # set by iterate(): this rank has another micro-batch
        self._ranks_with_more = 0.0  # set by step(): how many ranks have another micro-batch
        self._reset_window()

    # ----------------------------------------------------------------- schedule
    def steps_for(self, window: int) -> int:
        """Planned micro-batches in window ``window``."""
        if isinstance(self._steps, int):
            return self._steps
        if isinstance(self._steps, Sequence):
            return self._steps[min(window, len(self._steps) - 1)]
        return validate_steps_value(self._steps(window), f"steps({window})")

    # ----------------------------------------------------------------- iteration
    def iterate(self, loader: Iterable[Any]) -> Iterator[Micro]:
        """Yield micro-batches with window positions; ``micro.is_last`` marks each window's last.

        Each micro-batch is yielded before the next one is fetched when the loader has a len() (a
        list, a map-style DataLoader): is_last then comes from the count left. A loader without one
        (a generator, an IterableDataset) is read one micro-batch ahead, to know whether the data
        ends, except at a window's planned last micro-batch (where the window ends anyway) in a
        single-process run; in data-parallel runs the window's last looks ahead too. A loader that
        refills one buffer in place, or whose state is saved beside ``state_dict()``, needs a len().

        The body of the user's loop (forward and backward) runs inside this generator's DDP sync
        context: no DDP all-reduce except on a window's last micro-batch (FSDP2's flag is set in
        backward()). Data-parallel ranks agree on each window's length; see the module docstring.
        If the loader raises, the window in progress stays open: ``discard_window()`` drops it.
        """
        self._require_window_boundary("iterate()")
        yield from iterate_windows(self, loader)

    def _prepare_batchnorm(self, steps: int) -> None:
        if not self._batchnorm:
            return
        training = [name for name, layer in self._batchnorm if layer.training]
        if steps > 1 and training and not self._warned_batchnorm:
            self._warned_batchnorm = True
            logger.warning(
                "%d BatchNorm layer(s) (%s) train with %d micro-batches per step: each micro-batch is "
                "normalised with its own statistics, so gradients differ from the full batch's. Use "
                "larger micro-batches, convert with microbatch.convert_batchnorm_to_groupnorm(model), "
                "or freeze them (eval mode); correct_batchnorm_momentum=True makes the running "
                "statistics decay once per window.",
                len(training),
                ", ".join(training[:3]) + ("..." if len(training) > 3 else ""),
                steps,
            )
        self._set_batchnorm_momentum(self.window, steps)

    def _set_batchnorm_momentum(self, window: int, steps: int | None = None) -> None:
        """correct_batchnorm_momentum: set the momentum for ``window``'s planned steps.

        Set at construction and after every step() (for the next window), so a loop that calls
        backward()/step() by hand gets it as iterate() does; a window ended early with
        step(partial=True) decays by its planned count, not its actual one.
        """
        if not (self._correct_batchnorm and self._batchnorm):
            return
        steps = self.steps_for(window) if steps is None else steps
        for name, layer in self._batchnorm:
            momentum = self._batchnorm_momentum[name]
            if momentum is not None:
                layer.momentum = corrected_momentum(momentum, steps)

    # ----------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, *, items: int | float | torch.Tensor | None = None) -> None:
        """Add ``items / R * grad(loss)`` to the gradients; ``loss`` is a mean over ``items`` items.

        Without ``items`` the micro-batch weighs by its batch size (its first tensor's first
        dimension), so short micro-batches and a short last window stay exact.
        """
        if self._awaiting_step:
            raise UsageError(
                "backward() after the window's last micro-batch: call step() first "
                f"(window {self.window} already has {self._micro_batches} micro-batches)"
            )
        check_loss(loss)
        padding = self._current is not None and self._current.is_padding
        if items is None:
            if self._current is None:
                raise ConfigError(
                    "backward() without items= needs the micro-batch from acc.iterate(loader); "
                    "pass items= (samples or tokens the loss averages over)"
                )
            items_value: float | torch.Tensor = float(batch_size_of(self._current.batch))
        else:
            items_value = validate_items(items)

        if padding:
            items_value = 0.0  # a repeated micro-batch that only keeps this rank in step

        sum_dtype = torch.float32 if loss.device.type == "mps" else torch.float64
        items_value, weight = self._weight(items_value, loss, sum_dtype)
        weighted = loss.reshape(()) * weight
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        # FSDP2 reduce-scatters in this backward only on a window's last micro-batch (or always when
        # asked, or outside iterate(), where the window's end is not known in advance).
        sync = self._current is None or self._current.is_last or self.sync_every_micro_batch
        if self._data_parallel == "fsdp":
            with distributed.fsdp_sync(self.model, enabled=sync):
                weighted.backward()
        else:
            weighted.backward()

        if not padding:
            self._items = self._items + items_value
            # Summed on the loss's device, no host sync per micro-batch; float64 where the device has it.
            self._loss_sum = self._loss_sum + loss.detach().reshape(()).to(sum_dtype) * items_value
            if isinstance(items_value, torch.Tensor):
                self._item_flags = tensor_item_flags(items_value, loss, self._item_flags)
        self._micro_batches += 1
        if self._current is not None:
            self._awaiting_step = self._current.is_last
        else:
            self._awaiting_step = self._micro_batches >= self.steps_for(self.window)

    def _weight(
        self, items: float | torch.Tensor, loss: torch.Tensor, sum_dtype: torch.dtype
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(items, items / R): a device count stays on the device, weighted there, read once per window."""
        if isinstance(items, torch.Tensor):
            items = items.to(device=loss.device, dtype=sum_dtype, non_blocking=True)
        if self._micro_batches == 0:
            self._reference_items = self._reference_count(items)
        weight = items / self._reference_items
        if isinstance(weight, torch.Tensor):
            weight = weight.to(loss.dtype)
        return items, weight

    def _discard_window(self) -> None:
        for p in self._params:
            p.grad = None
        self._reset_window()

    def _reference_count(self, first_items: float | torch.Tensor) -> float | torch.Tensor:
        """R: an estimate of this rank's window total, identical on all ranks (see module docstring)."""
        steps = self.steps_for(self.window)
        if self._items_per_micro is not None:
            return max(self._items_per_micro * steps, 1.0)
        if isinstance(first_items, torch.Tensor):
            estimate_tensor = (first_items * steps).clamp(min=1.0)
            if self._data_parallel is not None:
                distributed.all_reduce_max_(estimate_tensor)  # on the device: no host sync
            return estimate_tensor
        estimate = first_items * steps
        if self._data_parallel is not None:
            # Averaged gradients must be weighted alike on every rank: agree once, on the first window.
            (estimate,) = distributed.all_reduce_values([estimate], op="max")
        return max(estimate, 1.0)

    # ----------------------------------------------------------------- step
    def step(self, *, partial: bool = False) -> WindowStats:
        """Finish the window: unscale, normalise, clip, step, schedule, zero. See the module docstring.

        Call it on a window's last micro-batch (``micro.is_last``). ``partial=True`` ends a window
        early when not using iterate() (the data ran out); it stays exact.
        """
        if self._micro_batches == 0:
            raise UsageError("step() with no backward() in this window: there is no gradient to apply")
        if not self._awaiting_step and not partial:
            raise UsageError(
                f"step() before the window's last micro-batch ({self._micro_batches} of "
                f"{self.steps_for(self.window)} done); call it when micro.is_last, or pass partial=True "
                "to end the window early"
            )
        items, loss_sum_local, reference = read_window(self)
        total_items, loss_sum, total_micro_batches, averaged_over = self._agree_on_totals(
            items, loss_sum_local
        )
        # Transactional: everything that can fail is read first; the gradients change only right
        # before the optimizer step, and are changed back if it raises (a retry is then exact).
        lr = learning_rate(self.optimizer)
        scaled = scale_gradients(self, reference * averaged_over / total_items)
        optimizer_step(self, scaled)
        if self.scaler is not None:
            self.scaler.update()
        if not scaled.skipped and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._params:
            p.grad = None

        stats = WindowStats(
            loss=loss_sum / total_items,
            items=round(total_items),
            grad_norm=scaled.grad_norm,
            lr=lr,
            skipped=scaled.skipped,
            window=self.window,
            micro_batches=self._micro_batches,
        )
        # Summed over ranks, so every rank derives the same reference count R for later windows.
        self._items_per_micro = total_items / total_micro_batches
        self.window += 1
        self._reset_window()
        self._set_batchnorm_momentum(self.window)
        return stats

    def _agree_on_totals(self, items: float, loss_sum: float) -> tuple[float, float, float, int]:
        """(T, loss sum, micro-batches) over all ranks, and W_avg; sets how many ranks have more data."""
        local = [items, loss_sum, float(self._micro_batches), float(self._has_more_local)]
        averaged_over = 1
        if self._data_parallel is not None:
            # One all_reduce per window: global items T, loss sum, micro-batches, ranks with more data.
            local = distributed.all_reduce_values(local)
            averaged_over = distributed.world_size()  # DDP and FSDP2 divide the summed gradient by W
        total_items, total_loss, total_micro_batches, self._ranks_with_more = local
        if total_items <= 0:
            raise UsageError("step() on a window without items on any rank: there is no gradient to apply")
        return total_items, total_loss, total_micro_batches, averaged_over

    def discard_window(self) -> None:
        """Drop the window in progress: its gradients and counts; the window index stays.

        The way out after a loader, a forward or an optimizer raised mid-window (state_dict() and
        iterate() refuse a window in progress): the next window then starts from zero gradients
        and is exact. Parameters, optimizer, scheduler and scaler are untouched.
        """
        for p in self._params:
            p.grad = None
        if self._wide is not None:
            self._wide.sums.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def _reset_window(self) -> None:
        self._items = 0.0
        self._item_flags = None
        self._loss_sum = 0.0
        self._micro_batches = 0
        self._reference_items = 1.0
        self._awaiting_step = False
        self._current = None

    def _require_window_boundary(self, what: str) -> None:
        if self._micro_batches:
            raise UsageError(
                f"{what} in the middle of window {self.window} ({self._micro_batches} micro-batches done); "
                "finish the window with step() first"
            )

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Resumable state at a window boundary (save model, optimizer, scheduler, scaler alongside).

        Save a stateful loader's state beside it: iterate() has not fetched past the window's last
        micro-batch when the loader has a len(). Without one (a generator, an IterableDataset), it
        has in data-parallel runs, so that loader is one micro-batch ahead; see iterate().
        """
        self._require_window_boundary("state_dict()")
        return {"version": 1, "window": self.window, "items_per_micro": self._items_per_micro}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._require_window_boundary("load_state_dict()")
        if not isinstance(state, dict) or state.get("version") != 1 or "window" not in state:
            raise ConfigError("not an Accumulator state_dict (expected keys 'version' = 1 and 'window')")
        self.window = int(state["window"])
        self._items_per_micro = state.get("items_per_micro")
        self._set_batchnorm_momentum(self.window)


def _check_options(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: StepsSchedule, max_grad_norm: float | None
) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(steps, (int, bool)):
        validate_steps_value(steps, "steps")
    elif isinstance(steps, Sequence):
        if len(steps) == 0:
            raise ConfigError("steps as a sequence must have at least one entry")
        for i, value in enumerate(steps):
            validate_steps_value(value, f"steps[{i}]")
    elif not callable(steps):
        raise ConfigError(
            f"steps must be an int, a sequence of ints or a callable, got {type(steps).__name__}"
        )
    if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ConfigError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm}")


def _parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The model's parameters and then the optimizer's others, warning about mismatches."""
    model_params = list(model.parameters())
    known = {id(p) for p in model_params}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in known]
    if foreign:
        logger.warning(
            "the optimizer holds %d parameter(s) that are not in the model; they are stepped but "
            "their gradients are not produced by this model (check that model and optimizer match)",
            len(foreign),
        )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unstepped = [p for p in model_params if p.requires_grad and id(p) not in stepped]
    if unstepped:
        logger.warning(
            "%d model parameter(s) require grad but are not in the optimizer: their gradients are "
            "computed and discarded at each step(), and left out of normalising and clipping "
            "(freeze them with requires_grad_(False), or add them to the optimizer)",
            len(unstepped),
        )
    return model_params + foreign
