"""The window's state: one object, one owner (the Accumulator), one discard path.

Everything a window accumulates between its first backward() and its step() lives in
``WindowState``: this rank's item count and item-weighted loss sum (device tensors or numbers,
read once per window), the reference count R of the window's first backward, the item flags of
device counts, the wide float32 sums and their hooks (precision.WideGradients), the micro-batch
iterate() handed out, how many ranks have another micro-batch, and how far a step() that raised
got. ``discard()`` drops all of it (the gradients too); ``finish()`` ends a window that stepped.
The helpers of iteration.py and window.py receive this object, never the Accumulator.
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UsageError
from ..stepping.step_guard import StepProgress
from .micro import Micro, tensor_item_flags
from .precision import WideGradients, wide_parameters

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class WindowState:
    """What the window in progress has accumulated; see the module docstring."""

    params: list[nn.Parameter]
    wide: WideGradients | None = None
    window: int = 0  # index of the window in progress (= optimizer steps taken or skipped)
    items: float | torch.Tensor = 0.0
    loss_sum: float | torch.Tensor = 0.0
    micro_batches: int = 0
    reference_items: float | torch.Tensor = 1.0
    item_flags: torch.Tensor | None = None  # see micro.tensor_item_flags
    awaiting_step: bool = False
    current: Micro | None = None  # the micro-batch iterate() handed out
    has_more_local: bool = False  # set by iterate(): this rank has another micro-batch
    ranks_with_more: float = 0.0  # set by step(): how many ranks have another micro-batch
    progress: StepProgress = field(default_factory=StepProgress)
    iterating: bool = False  # an iterate() generator is running
    warned_plan_batch: bool = False  # iteration warned that a window is not the plan's batch
    closed: bool = False

    def hooked(self) -> set[int]:
        """Ids of the parameters whose gradients this window's wide sums take (hooks)."""
        return {id(p) for p in self.wide.params} if self.wide is not None and not self.closed else set()

    def add(self, loss: torch.Tensor, items: float | torch.Tensor, sum_dtype: torch.dtype) -> None:
        """Count a (non-padding) micro-batch: on the loss's device, no host sync."""
        self.items = self.items + items
        self.loss_sum = self.loss_sum + loss.detach().reshape(()).to(sum_dtype) * items
        if isinstance(items, torch.Tensor):
            self.item_flags = tensor_item_flags(items, loss, self.item_flags)

    @property
    def step_began(self) -> bool:
        return self.progress.began

    def reset(self) -> None:
        """Counts back to an empty window (the gradients are the caller's: see discard/finish)."""
        self.items = 0.0
        self.loss_sum = 0.0
        self.micro_batches = 0
        self.reference_items = 1.0
        self.item_flags = None
        self.awaiting_step = False
        self.progress = StepProgress()

    def discard(self) -> None:
        """Drop the window: its gradients, its wide sums and its counts (the window index stays)."""
        for p in self.params:
            p.grad = None
        if self.wide is not None:
            self.wide.sums.clear()
        self.reset()

    def finish(self) -> None:
        """The window stepped: the next one starts from no gradients and no sums."""
        self.discard()
        self.window += 1

    def close(self) -> None:
        """Discard the window, remove the wide sums' hooks and give up the parameters."""
        if self.closed:
            return
        self.discard()
        if self.wide is not None:
            self.wide.remove_hooks()
        self.closed = True

    def require_open(self, what: str) -> None:
        if self.closed:
            raise UsageError(f"{what} on a closed Accumulator: build a new one")

    def require_boundary(self, what: str) -> None:
        if self.micro_batches or self.step_began:
            raise UsageError(
                f"{what} in the middle of window {self.window} ({self.micro_batches} micro-batches done); "
                "finish the window with step() first (or drop it with discard_window())"
            )


# Every live WindowState (weakly): a new Accumulator must not share parameters with one whose
# wide sums' hooks take their gradients (or hook parameters another one accumulates into).
_LIVE: weakref.WeakSet[WindowState] = weakref.WeakSet()


def new_state(
    params: list[nn.Parameter], accumulate_dtype: torch.dtype | None, model_name: str
) -> WindowState:
    """The WindowState of a new Accumulator; UsageError when another open one would take its gradients."""
    hooked = {id(p) for p in wide_parameters(params, accumulate_dtype)} if accumulate_dtype else set()
    mine = {id(p) for p in params}
    if _conflicts(mine, hooked):
        gc.collect()  # an Accumulator dropped inside a reference cycle is no owner
    if _conflicts(mine, hooked):
        raise UsageError(
            f"another Accumulator on this {model_name} is still open, and one of the two sums gradients in "
            "accumulate_dtype: its gradient hooks would take every gradient of the other, which would step "
            "nothing. Call acc.close() (or plan.remove(model)) on the first one before building another"
        )
    wide = WideGradients(params, accumulate_dtype) if accumulate_dtype is not None else None
    state = WindowState(params, wide)
    _LIVE.add(state)
    return state


def _conflicts(mine: set[int], hooked: set[int]) -> bool:
    for other in list(_LIVE):
        if other.closed:
            continue
        if other.hooked() & mine:
            return True
        if hooked and any(id(p) in hooked for p in other.params):
            return True
    return False


def window_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
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
