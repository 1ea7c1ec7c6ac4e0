"""What Accumulator hands out and returns (Micro, WindowStats), and the checks on what users pass it
(steps per window, item counts)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

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


def validate_steps_value(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where} must be an integer >= 1 (micro-batches per optimizer step), got {value!r}"
        )
    if value < 1:
        raise ConfigError(f"{where} must be >= 1 (micro-batches per optimizer step), got {value}")
    return value


def validate_items(items: object) -> float | torch.Tensor:
    """A number checked now, or a one-element tensor kept on its device (its value is checked once
    per window, in step(), so that no micro-batch waits for the device: see tensor_item_flags)."""
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


def check_loss(loss: object) -> None:
    """A loss backward() can weight: a scalar tensor that requires grad."""
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


def learning_rate(optimizer: torch.optim.Optimizer) -> float | None:
    """The first parameter group's 'lr' as a float; None when there is none (it is optional)."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if lr is None:
        return None
    try:
        return float(lr)
    except (TypeError, ValueError):
        return None


def tensor_item_flags(items: torch.Tensor, loss: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """Flags, on the device, for a count that is negative, not finite or not whole (0), and for an
    empty micro-batch whose mean loss is not finite, 0/0 (1); step() reads them with the counts."""
    bad = ~torch.isfinite(items) | (items < 0) | (items != torch.round(items))
    empty = (items == 0) & ~torch.isfinite(loss.detach().reshape(()))
    flags = torch.stack([bad, empty])
    return flags if previous is None else previous | flags


def check_not_already_scaled(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Refuse a loss that ``scaler.scale`` already multiplied: backward() scales it once more.

    GradScaler.scale(loss) is ``loss * scale`` with the scaler's own scale tensor, so the loss's
    autograd node (or one a few ops below it, as in ``scaler.scale(loss) / n``) is a multiply that
    saved that tensor. Comparing storage pointers reads no value from the device: no host sync.
    """
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    if not isinstance(scale, torch.Tensor):
        return  # the scaler has not scaled anything yet
    pointer = scale.data_ptr()
    frontier, seen = [loss.grad_fn], 0
    while frontier and seen < _SCALE_SEARCH_NODES:
        node = frontier.pop(0)
        if node is None:
            continue
        seen += 1
        if type(node).__name__ == "MulBackward0" and any(
            isinstance(t, torch.Tensor) and t.data_ptr() == pointer for t in _saved_operands(node)
        ):
            raise ConfigError(
                "backward(loss): the loss was already multiplied by the Accumulator's GradScaler "
                "(scaler.scale(loss)); backward() scales it itself, so the gradient would be scaled twice. "
                "Pass the unscaled loss: acc.backward(loss)"
            )
        frontier.extend(next_node for next_node, _ in node.next_functions)


_SCALE_SEARCH_NODES = 4  # the loss's node and the few below it: scale(loss), then / n or .mean()


def _saved_operands(node: Any) -> list[Any]:
    found = []
    for name in ("_saved_other", "_saved_self"):
        with contextlib.suppress(AttributeError, RuntimeError):  # not saved, or freed by a backward
            found.append(getattr(node, name))
    return found


def validated_state(state: object) -> tuple[int, float | None]:
    """(window, items per micro-batch) of an ``Accumulator.state_dict()``; ConfigError naming the field."""
    if not isinstance(state, dict) or state.get("version") != 1 or "window" not in state:
        raise ConfigError("not an Accumulator state_dict (expected keys 'version' = 1 and 'window')")
    window = state["window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(
            "Accumulator state_dict: 'window' must be a whole number >= 0 (optimizer steps taken), "
            f"got {window!r}"
        )
    per_micro = state.get("items_per_micro")
    if per_micro is not None and (
        isinstance(per_micro, bool)
        or not isinstance(per_micro, (int, float))
        or not math.isfinite(per_micro)
        or per_micro <= 0
    ):
        raise ConfigError(
            "Accumulator state_dict: 'items_per_micro' must be None or a positive finite number (the mean "
            f"items of a micro-batch), got {per_micro!r}"
        )
    return window, None if per_micro is None else float(per_micro)


def check_options(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: StepsSchedule,
    max_grad_norm: float | None,
    samples_per_window: int | None,
) -> None:
    """The Accumulator's arguments, checked before anything is built."""
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
    if samples_per_window is not None and (
        isinstance(samples_per_window, bool)
        or not isinstance(samples_per_window, int)
        or samples_per_window < 1
    ):
        raise ConfigError(f"samples_per_window must be a positive int or None, got {samples_per_window!r}")
