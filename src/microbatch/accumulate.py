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
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from . import distributed
from .batching import batch_size_of
from .batchnorm import batchnorm_layers, corrected_momentum
from .errors import ConfigError, UsageError
from .feed import Feed
from .precision import WideGradients

logger = logging.getLogger(__name__)

StepsSchedule = int | Sequence[int] | Callable[[int], int]


@dataclass(frozen=True)
class Micro:
    """One micro-batch handed out by ``Accumulator.iterate``.

    ``index`` counts micro-batches within the window (from 0), ``steps`` is the window's planned
    length, and ``is_last`` is True for the window's last micro-batch, also when the data ends early.
    ``is_padding`` is True only in data-parallel runs, on a rank whose data ran out before the
    others': ``batch`` repeats its last micro-batch, and backward() gives it weight 0 (run forward
    and backward as usual, so the ranks' collectives stay matched; skip it in your own metrics).
    """

    batch: Any
    index: int
    window: int
    steps: int
    is_last: bool
    is_padding: bool = False

    @property
    def is_first(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class WindowStats:
    """What one optimizer step saw.

    loss: the item-weighted mean loss of the window (the full batch's loss), over all ranks.
    items: the window's item count over all ranks. grad_norm: the total gradient norm before
    clipping. lr: the learning rate the step used (first parameter group; None when the optimizer
    has no 'lr', as transformers' Adafactor with lr=None). skipped: True when a
    non-finite gradient made the step be skipped (parameters, scheduler untouched).
    """

    loss: float
    items: int
    grad_norm: float
    lr: float | None
    skipped: bool
    window: int
    micro_batches: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        flag = " (skipped: non-finite gradient)" if self.skipped else ""
        lr = "none" if self.lr is None else f"{self.lr:.4g}"
        return (
            f"window {self.window}: loss {self.loss:.6g} over {self.items} items in {self.micro_batches} "
            f"micro-batches, grad norm {self.grad_norm:.4g}, lr {lr}{flag}"
        )


def _validate_steps_value(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where} must be an integer >= 1 (micro-batches per optimizer step), got {value!r}"
        )
    if value < 1:
        raise ConfigError(f"{where} must be >= 1 (micro-batches per optimizer step), got {value}")
    return value


def _validate_items(items: object) -> float | torch.Tensor:
    """A number checked now, or a one-element tensor kept on its device (its value is checked once
    per window, in step(), so that no micro-batch waits for the device: see _note_tensor_items)."""
    if isinstance(items, bool):
        raise ConfigError(f"items must be a positive count of samples or tokens, got {items!r}")
    if isinstance(items, torch.Tensor):
        if items.numel() != 1:
            raise ConfigError(f"items must be a single count, got a tensor of shape {tuple(items.shape)}")
        if items.requires_grad:
            items = items.detach()
        return items.reshape(())
    if isinstance(items, (int, float)):
        value = float(items)
    else:
        raise ConfigError(f"items must be an int or a one-element tensor, got {type(items).__name__}")
    if not math.isfinite(value):
        raise ConfigError(f"items must be finite, got {value}")
    if value <= 0:
        raise ConfigError(
            f"items must be > 0, got {value:g}: a micro-batch with no items (all padding) has no loss; "
            "skip it in the data, or pass its loss summed with items=1"
        )
    if value != int(value):
        raise ConfigError(f"items counts samples or tokens and must be a whole number, got {value}")
    return value


def _learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    """The first parameter group's 'lr' as a float; None when there is none (it is optional)."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if lr is None:
        return None
    try:
        return float(lr)
    except (TypeError, ValueError):
        return None


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
    _item_flags: torch.Tensor | None  # see _note_tensor_items
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
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(steps, (int, bool)):
            _validate_steps_value(steps, "steps")
        elif isinstance(steps, Sequence):
            if len(steps) == 0:
                raise ConfigError("steps as a sequence must have at least one entry")
            for i, value in enumerate(steps):
                _validate_steps_value(value, f"steps[{i}]")
        elif not callable(steps):
            raise ConfigError(
                f"steps must be an int, a sequence of ints or a callable, got {type(steps).__name__}"
            )
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ConfigError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm}")

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

        model_params = list(model.parameters())
        known = {id(p) for p in model_params}
        foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in known]
        if foreign:
            logger.warning(
                "the optimizer holds %d parameter(s) that are not in the model; they are stepped but "
                "their gradients are not produced by this model (check that model and optimizer match)",
                len(foreign),
            )
        # Every parameter whose gradient this accumulator clears at step(); it normalises and clips
        # exactly the optimizer's parameters: those are the ones GradScaler unscales.
        self._params: list[nn.Parameter] = model_params + foreign
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        unstepped = [p for p in model_params if p.requires_grad and id(p) not in stepped]
        if unstepped:
            logger.warning(
                "%d model parameter(s) require grad but are not in the optimizer: their gradients are "
                "computed and discarded at each step(), and left out of normalising and clipping "
                "(freeze them with requires_grad_(False), or add them to the optimizer)",
                len(unstepped),
            )
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
        return _validate_steps_value(self._steps(window), f"steps({window})")

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
        world = distributed.world_size()
        agree = self._data_parallel is not None and world > 1
        feed = Feed(loader)
        has_data = feed.has_more()
        if agree:
            (ranks_with_data,) = distributed.all_reduce_values([float(has_data)])
            if ranks_with_data < world:  # raised on every rank, so none waits for the others
                raise ConfigError(
                    f"the loader given to iterate() is empty on {world - round(ranks_with_data)} of "
                    f"{world} rank(s): every rank needs at least one micro-batch"
                )
        elif not has_data:
            raise ConfigError("the loader given to iterate() is empty: it produced no micro-batches")
        last_batch: Any = None
        exhausted = False  # this rank's data ran out (data-parallel: it pads until the others end)
        warned = False
        more = True
        while more:
            window = self.window
            steps = self.steps_for(window)
            self._prepare_batchnorm(steps)
            for index in range(steps):
                padding = exhausted
                batch = last_batch if padding else feed.take()
                last_batch = batch if agree else None  # kept only to pad with
                at_window_end = index == steps - 1
                if padding:
                    has_more = False
                elif at_window_end and not agree:
                    has_more = True  # decided after the window's step(), without fetching ahead
                else:
                    has_more = feed.has_more()
                exhausted = not has_more
                ranks_with_more = float(has_more)
                if agree and not at_window_end:  # at the window's end step() carries the count
                    (ranks_with_more,) = distributed.all_reduce_values([ranks_with_more])
                is_last = at_window_end or ranks_with_more == 0
                micro = Micro(
                    batch=batch, index=index, window=window, steps=steps, is_last=is_last, is_padding=padding
                )
                del batch
                self._current = micro
                self._has_more_local = has_more
                try:
                    with distributed.ddp_sync(self.model, enabled=is_last or self.sync_every_micro_batch):
                        yield micro
                finally:
                    self._current = None
                del micro
                if is_last:
                    if agree and at_window_end and self.window != window:
                        ranks_with_more = self._ranks_with_more
                    elif at_window_end and not agree:
                        ranks_with_more = float(feed.has_more())
                    break
                if not warned and agree and 0 < ranks_with_more < world:
                    warned = True
                    self._warn_uneven(ranks_with_more, world, window)
            if self.window == window:
                raise UsageError(
                    f"window {window} ended (micro.is_last was True) but step() was not called; "
                    "call acc.step() when micro.is_last"
                )
            more = ranks_with_more > 0
            if not warned and agree and 0 < ranks_with_more < world:
                warned = True
                self._warn_uneven(ranks_with_more, world, window)

    def _warn_uneven(self, ranks_with_more: float, world: int, window: int) -> None:
        distributed.log_rank_zero(
            logger,
            logging.WARNING,
            "the data ran out on %d of %d ranks in window %d: they repeat their last micro-batch with "
            "weight 0 (Micro.is_padding) until the other ranks finish, so the gradient stays exact; "
            "shard the data evenly (DistributedSampler) to avoid this idle compute",
            world - round(ranks_with_more),
            world,
            window,
        )

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
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ConfigError(
                "loss must be a scalar (a mean over the micro-batch's items), got shape "
                f"{tuple(loss.shape)}; reduce it with .mean() and pass items="
            )
        if not loss.requires_grad:
            raise ConfigError(
                "loss does not require grad: it was computed under torch.no_grad(), from a detached "
                "tensor, or from a model whose parameters are all frozen"
            )
        padding = self._current is not None and self._current.is_padding
        if items is None:
            if self._current is None:
                raise ConfigError(
                    "backward() without items= needs the micro-batch from acc.iterate(loader); "
                    "pass items= (samples or tokens the loss averages over)"
                )
            items_value: float | torch.Tensor = float(batch_size_of(self._current.batch))
        else:
            items_value = _validate_items(items)

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
                self._note_tensor_items(items_value, loss)
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

    def _note_tensor_items(self, items: torch.Tensor, loss: torch.Tensor) -> None:
        """Flag, on the device, a count that is negative, not finite or not whole (0), and an empty
        micro-batch whose mean loss is not finite, 0/0 (1); step() reads the flags with the counts."""
        bad = ~torch.isfinite(items) | (items < 0) | (items != torch.round(items))
        empty = (items == 0) & ~torch.isfinite(loss.detach().reshape(()))
        flags = torch.stack([bad, empty])
        self._item_flags = flags if self._item_flags is None else self._item_flags | flags

    def _read_window(self) -> tuple[float, float, float]:
        """This rank's items, loss sum and R as numbers: one read from the device per window."""
        values = [self._items, self._loss_sum, self._reference_items]
        flags, self._item_flags = self._item_flags, None
        on_device = [v for v in (*values, flags) if isinstance(v, torch.Tensor)]
        if not on_device:
            return float(values[0]), float(values[1]), float(values[2])
        device = on_device[0].device
        dtype = torch.float32 if device.type == "mps" else torch.float64
        read = iter(
            torch.cat([v.to(device=device, dtype=dtype).reshape(-1) for v in on_device]).cpu().tolist()
        )
        numbers = [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
        bad, empty = (next(read), next(read)) if flags is not None else (0.0, 0.0)
        if bad or empty:
            self._discard_window()
            raise ConfigError(
                f"window {self.window}: "
                + (
                    "an items count was negative, not finite or not a whole number"
                    if bad
                    else "a micro-batch with items=0 had a non-finite loss (0/0: no predicted tokens)"
                )
                + "; the window's gradients are discarded. Drop such micro-batches from the data"
            )
        return numbers[0], numbers[1], numbers[2]

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
        items, loss_sum_local, reference = self._read_window()
        local = [items, loss_sum_local, float(self._micro_batches), float(self._has_more_local)]
        if self._data_parallel is not None:
            # One all_reduce per window: global items T, loss sum, micro-batches, ranks with more data.
            total_items, loss_sum, total_micro_batches, self._ranks_with_more = distributed.all_reduce_values(
                local
            )
            averaged_over = distributed.world_size()  # DDP and FSDP2 divide the summed gradient by W
        else:
            total_items, loss_sum, total_micro_batches, self._ranks_with_more = local
            averaged_over = 1
        if total_items <= 0:
            raise UsageError("step() on a window without items on any rank: there is no gradient to apply")

        # Transactional: everything that can fail is read first; the gradients change only right
        # before the optimizer step, and are changed back if it raises (a retry is then exact).
        lr = _learning_rate(self.optimizer)
        factor = reference * averaged_over / total_items
        widened = self._wide.restore_(factor) if self._wide is not None else set()  # scaled in the wide dtype
        stepped = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the optimizer's gradients only, at most once a window
        grads = [p.grad for p in stepped if id(p) not in widened]
        wide = [p for p in stepped if id(p) in widened]
        # Normalising multiplies the other gradients by factor (the wide ones are already), so the
        # total norm is sqrt((factor * |others|)^2 + |wide|^2).
        grad_norm = math.hypot(factor * self._total_norm(grads), self._total_norm([p.grad for p in wide]))
        skipped = not math.isfinite(grad_norm)
        clip = 1.0
        if self.max_grad_norm is not None and not skipped:
            # torch.nn.utils.clip_grad_norm_'s coefficient, applied in the same multiply.
            clip = min(1.0, self.max_grad_norm / (grad_norm + 1e-6))
        multiplier = factor * clip
        if grads and multiplier != 1.0:
            torch._foreach_mul_(grads, multiplier)
        wide_grads = [p.grad for p in wide if p.grad is not None]
        if wide_grads and clip != 1.0:
            torch._foreach_mul_(wide_grads, clip)
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # skips by itself when unscale_ found inf/nan
            elif not skipped:
                self.optimizer.step()
            else:
                logger.warning(
                    "window %d: non-finite gradient norm (%s); optimizer step skipped", self.window, grad_norm
                )
        except BaseException:
            self._restore_grads(grads, multiplier, wide, clip, factor)
            raise
        if self.scaler is not None:
            self.scaler.update()
        if not skipped and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._params:
            p.grad = None

        stats = WindowStats(
            loss=loss_sum / total_items,
            items=round(total_items),
            grad_norm=grad_norm,
            lr=lr,
            skipped=skipped,
            window=self.window,
            micro_batches=self._micro_batches,
        )
        # Summed over ranks, so every rank derives the same reference count R for later windows.
        self._items_per_micro = total_items / total_micro_batches
        self.window += 1
        self._reset_window()
        self._set_batchnorm_momentum(self.window)
        return stats

    @staticmethod
    def _total_norm(grads: list[torch.Tensor]) -> float:
        if not grads:
            return 0.0
        norm = nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor norm
            norm = norm.full_tensor()
        return float(norm)

    def _restore_grads(
        self,
        grads: list[torch.Tensor],
        multiplier: float,
        wide: list[nn.Parameter],
        clip: float,
        factor: float,
    ) -> None:
        """Undo step()'s changes after the optimizer raised: the window's gradients as before step()."""
        if grads and multiplier != 1.0:
            torch._foreach_div_(grads, multiplier)  # within one rounding of the gradients before
        wide_grads = [p.grad for p in wide if p.grad is not None]
        if wide_grads and clip != 1.0:
            torch._foreach_div_(wide_grads, clip)
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            everything = grads + wide_grads
            if everything and scale != 1.0:
                torch._foreach_mul_(everything, scale)  # a power of two: exactly undoes unscale_
            # Forget that unscale_ ran for this optimizer, so a retried step() may call it again.
            self.scaler._per_optimizer_states.pop(id(self.optimizer), None)
        if self._wide is not None:
            for p in wide:  # back into the wide sums, unnormalised, as before restore_()
                if p.grad is not None:
                    self._wide.sums[id(p)] = p.grad.to(self._wide.dtype) / factor
                p.grad = None
        logger.warning(
            "window %d: the optimizer step raised; the window's gradients are restored, so step() can "
            "be retried or the window dropped with discard_window()",
            self.window,
        )

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
