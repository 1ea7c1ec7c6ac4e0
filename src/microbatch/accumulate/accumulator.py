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
optimizer step (skipped on a non-finite gradient) -> scaler update -> scheduler step (only when the
optimizer stepped) -> zero_grad(set_to_none=True). Normalising and clipping act on the optimizer's
parameters (the ones GradScaler unscales), as one multiply made just before the optimizer step.

What holds when step() raises (state.py keeps how far it got):
- reading the counts or their collective: nothing changed; a retry is exact (a failed item check
  discards the window itself, with a ConfigError).
- unscaling, normalising or clipping (an OOM computing the norm): the gradients are partly
  scaled, nothing was stepped; step() refuses a retry, discard_window() drops the window.
- inside the optimizer's step: the gradients are put back (and the scaler's unscale forgotten). If
  the optimizer had changed nothing yet (its parameters' and state's version counters did not
  move: window.optimizer_step), a retry is exact. If it had, the step is half made and cannot be
  undone here: step() refuses a retry (it would apply part of the step twice); restore model and
  optimizer from a checkpoint, then discard_window(). ``step_began`` is True from then on, so a
  training loop knows not to run the window again.
- after the optimizer step (the scaler update, the scheduler): the optimizer stepped once and will
  not step again; a retry of step() runs only what did not happen and returns the window's stats.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..errors import ConfigError, UsageError
from ..stepping.step_guard import refuse_retry, refuse_work_while_step_unfinished
from ..trees.batches import batch_size_of
from .batchnorm import BatchNormWindows
from .foreign import refuse_foreign_accumulation
from .iteration import Windows, iterate_windows, refuse_nested
from .micro import (
    Micro,
    StepsSchedule,
    WindowStats,
    check_loss,
    check_not_already_scaled,
    check_options,
    learning_rate,
    validate_items,
    validate_steps_value,
    validated_state,
)
from .state import WindowState, new_state, window_parameters
from .window import agree_on_totals, optimizer_step, read_window, scale_gradients

logger = logging.getLogger(__name__)

__all__ = ["Accumulator", "Micro", "StepsSchedule", "WindowStats"]


class Accumulator:
    """Gradient accumulation whose window gradient equals the full-batch gradient.

    ``steps`` is the number of micro-batches per optimizer step: an int, a sequence (one entry per
    window; the last entry repeats), or a callable ``window_index -> steps`` (accumulation warmup).
    ``scheduler`` steps once per optimizer step that was taken; ``max_grad_norm`` clips once, on the
    accumulated and unscaled gradient; ``scaler`` (torch.amp.GradScaler) scales each backward and
    unscales once per window (pass the unscaled loss to backward()). For data parallelism pass the
    wrapped model (the DistributedDataParallel module itself, or the fully_shard root): gradient sync
    then runs only on a window's last micro-batch, or on every one with ``sync_every_micro_batch``
    (less memory, more communication). ``correct_batchnorm_momentum`` sets each BatchNorm's momentum
    so a window of N micro-batches decays its running statistics like one update.
    ``accumulate_dtype`` (e.g. torch.float32) sums low-precision parameters' gradients in that dtype
    across the window and rounds once at ``step()`` (see precision.py; single process only); its
    gradient hooks stay until ``close()``, and a second Accumulator on the same model is refused
    until then. ``samples_per_window`` (plan.apply passes the plan's per-rank batch): iterate()
    warns once when a full window holds another number of samples. What holds when step() raises:
    see the module docstring.
    """

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
        samples_per_window: int | None = None,
    ) -> None:
        check_options(model, optimizer, steps, max_grad_norm, samples_per_window)
        refuse_foreign_accumulation(optimizer)  # Accelerate's own accumulation would drop our steps
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.sync_every_micro_batch = sync_every_micro_batch
        self.samples_per_window = samples_per_window
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
        if accumulate_dtype is not None and self._data_parallel is not None:
            raise ConfigError(
                "accumulate_dtype with DDP / FSDP is not supported: their gradient hooks read .grad, which "
                "a wide accumulation empties between micro-batches; leave accumulate_dtype=None"
            )
        # The window's state, with every parameter whose gradient this accumulator clears at step()
        # (it normalises and clips exactly the optimizer's: those are the ones GradScaler unscales),
        # and the wide sums of low-precision gradients (precision.py).
        self._state: WindowState = new_state(
            window_parameters(model, optimizer), accumulate_dtype, type(model).__name__
        )

        # For a manual backward()/step() loop too, not only iterate(): set for window 0 now.
        # (No bound method of self is kept: a dropped Accumulator is freed at once, hooks included.)
        self._batchnorm = BatchNormWindows(model, correct_batchnorm_momentum)
        self._correct_batchnorm_momentum()
        self._items_per_micro: float | None = None  # running estimate, for the reference count R

    @property
    def window(self) -> int:
        """Index of the window in progress (= optimizer steps taken or skipped)."""
        return self._state.window

    @window.setter
    def window(self, value: int) -> None:
        self._state.require_boundary("setting acc.window")
        self._state.window = value

    @property
    def _warned_batchnorm(self) -> bool:  # set by the planner's trial windows, which say it once
        return self._batchnorm.warned

    @_warned_batchnorm.setter
    def _warned_batchnorm(self, value: bool) -> None:
        self._batchnorm.warned = value

    def _correct_batchnorm_momentum(self) -> None:
        if self._batchnorm.corrects:  # steps_for only then: a user's schedule is asked no more than needed
            self._batchnorm.set_momentum(self.steps_for(self.window))

    @property
    def step_began(self) -> bool:
        """True when the window's optimizer step began and the window is not finished.

        The optimizer's step raised (whatever it had changed), or it returned and a later part of
        step() raised. Such a window must never be run again from its start: its update is (at
        least partly) made. A training loop re-runs a failed window only while this is False.
        """
        return self._state.step_began

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
        One iterate() at a time: a nested one is refused.
        """
        self._state.require_open("iterate()")
        refuse_nested(self._state)
        self._state.require_boundary("iterate()")
        windows = Windows(
            model=self.model,
            data_parallel=self._data_parallel,
            sync_every_micro_batch=self.sync_every_micro_batch,
            steps_for=self.steps_for,
            start_window=self._batchnorm.prepare,
            samples_per_window=self.samples_per_window,
        )
        yield from iterate_windows(self._state, windows, loader)

    # ----------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor, *, items: int | float | torch.Tensor | None = None) -> None:
        """Add ``items / R * grad(loss)`` to the gradients; ``loss`` is a mean over ``items`` items.

        Without ``items`` the micro-batch weighs by its batch size (its first tensor's first
        dimension), so short micro-batches and a short last window stay exact. Pass the loss
        unscaled: with ``scaler=`` backward() scales it (a loss already scaled is refused).
        """
        state = self._state
        state.require_open("backward()")
        refuse_work_while_step_unfinished(
            state.progress,
            "backward()",
            state.window,
            fix="call step() again "
            "(or discard_window() after restoring from a checkpoint, if step() says so)",
        )
        if state.awaiting_step:
            raise UsageError(
                "backward() after the window's last micro-batch: call step() first "
                f"(window {state.window} already has {state.micro_batches} micro-batches)"
            )
        check_loss(loss)
        check_not_already_scaled(loss, self.scaler)
        current = state.current
        if items is None:
            if current is None:
                raise ConfigError(
                    "backward() without items= needs the micro-batch from acc.iterate(loader); "
                    "pass items= (samples or tokens the loss averages over)"
                )
            items_value: float | torch.Tensor = float(batch_size_of(current.batch))
        else:
            items_value = validate_items(items)
        padding = current is not None and current.is_padding
        if padding:
            items_value = 0.0  # a repeated micro-batch that only keeps this rank in step

        sum_dtype = torch.float32 if loss.device.type == "mps" else torch.float64
        items_value, weight = self._weight(items_value, loss, sum_dtype)
        weighted = loss.reshape(()) * weight
        if self.scaler is not None:
            weighted = self.scaler.scale(weighted)
        # FSDP2 reduce-scatters in this backward only on a window's last micro-batch (or always when
        # asked, or outside iterate(), where the window's end is not known in advance).
        sync = current is None or current.is_last or self.sync_every_micro_batch
        if self._data_parallel == "fsdp":
            with distributed.fsdp_sync(self.model, enabled=sync):
                weighted.backward()
        else:
            weighted.backward()

        if not padding:
            state.add(loss, items_value, sum_dtype)
        state.micro_batches += 1
        if current is not None:
            state.awaiting_step = current.is_last
        else:
            state.awaiting_step = state.micro_batches >= self.steps_for(state.window)

    def _weight(
        self, items: float | torch.Tensor, loss: torch.Tensor, sum_dtype: torch.dtype
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(items, items / R): a device count stays on the device, weighted there, read once per window."""
        if isinstance(items, torch.Tensor):
            items = items.to(device=loss.device, dtype=sum_dtype, non_blocking=True)
        if self._state.micro_batches == 0:
            self._state.reference_items = self._reference_count(items)
        weight = items / self._state.reference_items
        if isinstance(weight, torch.Tensor):
            weight = weight.to(loss.dtype)
        return items, weight

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
        early in a loop without iterate() (the data ran out); it stays exact. After step() raised,
        calling it again redoes only what did not happen (see the module docstring).
        """
        state = self._state
        state.require_open("step()")
        if state.progress.stats is None:
            self._check_step_call(partial)
            state.progress.stats = self._apply_window()
        return self._finish_window()

    def _check_step_call(self, partial: bool) -> None:
        state = self._state
        refuse_retry(state.progress, state.window, drop="acc.discard_window()")
        if state.micro_batches == 0:
            raise UsageError("step() with no backward() in this window: there is no gradient to apply")
        if state.awaiting_step:
            return
        if state.iterating:
            raise UsageError(
                f"step() in the middle of iterate()'s window {state.window} ({state.micro_batches} of "
                f"{self.steps_for(state.window)} micro-batches done): iterate() ends windows itself; call "
                "step() when micro.is_last (partial=True is for loops without iterate())"
            )
        if not partial:
            raise UsageError(
                f"step() before the window's last micro-batch ({state.micro_batches} of "
                f"{self.steps_for(state.window)} done); call it when micro.is_last, or pass partial=True "
                "to end the window early"
            )

    def _apply_window(self) -> WindowStats:
        """Everything up to and including the optimizer step; the stats of the window."""
        state = self._state
        items, loss_sum_local, reference = read_window(state)
        total_items, loss_sum, total_micro_batches, averaged_over = agree_on_totals(
            state, items, loss_sum_local, data_parallel=self._data_parallel is not None
        )
        # What can fail is read first; the gradients change only from here (see the module docstring).
        lr = learning_rate(self.optimizer)
        scaled = scale_gradients(
            state, self.optimizer, self.scaler, self.max_grad_norm, reference * averaged_over / total_items
        )
        optimizer_step(state, self.optimizer, self.scaler, scaled)
        # Summed over ranks, so every rank derives the same reference count R for later windows.
        self._items_per_micro = total_items / total_micro_batches
        return WindowStats(
            loss=loss_sum / total_items,
            items=round(total_items),
            grad_norm=scaled.grad_norm,
            lr=lr,
            skipped=scaled.skipped,
            window=state.window,
            micro_batches=state.micro_batches,
        )

    def _finish_window(self) -> WindowStats:
        """After the optimizer step: scaler update, scheduler step, zero; each done once per window."""
        progress = self._state.progress
        stats: WindowStats | None = progress.stats
        if stats is None:  # set by _apply_window before this runs; narrows the type
            raise UsageError("step(): the window has no optimizer step to finish")
        if not progress.scaler_updated:
            if self.scaler is not None:
                self.scaler.update()
            progress.scaler_updated = True
        if not progress.scheduled:
            if not stats.skipped and self.scheduler is not None:
                self.scheduler.step()
            progress.scheduled = True
        self.optimizer.zero_grad(set_to_none=True)
        self._state.finish()
        self._correct_batchnorm_momentum()
        return stats

    def discard_window(self) -> None:
        """Drop the window in progress: its gradients, wide sums and counts; the window index stays.

        The way out after a loader, a forward or a backward raised mid-window (state_dict() and
        iterate() refuse a window in progress), or after step() said the optimizer's step was half
        made (restore model and optimizer first). The next window then starts from zero gradients
        and is exact. Parameters, optimizer, scheduler and scaler are untouched. Refused once the
        optimizer's step is done: step() again finishes that window.
        """
        state = self._state
        if state.progress.stats is not None:
            raise UsageError(
                f"discard_window(): window {state.window}'s optimizer step is done (a later part of step() "
                "raised); call step() again: it runs only what did not happen"
            )
        state.discard()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Drop the window in progress and remove the gradient hooks (accumulate_dtype); final.

        Another Accumulator on the same model may be built afterwards. plan.remove(model) closes
        the Accumulator its plan.apply built.
        """
        self._state.close()

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Resumable state at a window boundary (save model, optimizer, scheduler, scaler alongside).

        Save a stateful loader's state beside it: iterate() has not fetched past the window's last
        micro-batch when the loader has a len(). Without one (a generator, an IterableDataset), it
        has in data-parallel runs, so that loader is one micro-batch ahead; see iterate().
        """
        self._state.require_boundary("state_dict()")
        return {"version": 1, "window": self.window, "items_per_micro": self._items_per_micro}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; its fields are checked (ConfigError naming the field) first."""
        self._state.require_boundary("load_state_dict()")
        window, items_per_micro = validated_state(state)
        self._state.window = window
        self._items_per_micro = items_per_micro
        self._correct_batchnorm_momentum()
