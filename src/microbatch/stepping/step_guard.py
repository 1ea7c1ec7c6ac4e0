"""The step rules every window maker keeps (the Accumulator, the Pipeline).

A window is many micro-batches and one optimizer step. What may go wrong around that step, and
what each maker must then do, is the same for both:

- **A step that began is never repeated.** Once the optimizer's step raised or returned, the
  window cannot be run again (its micro-batches would add into gradients already stepped on, or
  the step would be applied twice). ``StepProgress`` records how far the step got; work on a new
  window is refused until the step is finished or the window dropped
  (``refuse_work_while_step_unfinished``), and a retry that could apply part of a step twice is
  refused (``refuse_retry``).
- **Was anything changed?** ``guarded_optimizer_step`` runs the optimizer's step and, if it
  raises, reads from version counters whether it had changed a parameter or the optimizer's state
  first (``optimizer_fingerprint``): a clean failure may be retried, a half-made step may not.
- **items > 0.** A window's loss is a mean over its items; a window without items on any rank
  has no gradient to apply (``require_items``). A micro-batch without items adds an exact zero,
  never the 0/0 of a mean over nothing (the Accumulator refuses items=0; the Pipeline counts items
  before calling the loss and does not call it on one without).
- **Options honoured or refused by name.** A maker that cannot honour an option (a GradScaler, a
  wide ``accumulate_dtype``) refuses it with its name and the way out (``refuse_option``), never
  runs without it silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, UsageError


@dataclass
class StepProgress:
    """How far the window's step got, so a retry redoes only what did not happen.

    ``scaling_failed``: unscaling or normalising raised (the window can only be dropped).
    ``optimizer_raised``: optimizer.step() raised (the gradients were restored). ``mutated``: it had
    changed parameters or optimizer state in place before raising (a retry would apply part of the
    step twice). ``stats``: set once the optimizer step returned; the scaler update and the
    scheduler step follow, each marked done as it returns.
    """

    scaling_failed: bool = False  # unscaling / normalising raised: the gradients are partly scaled
    optimizer_raised: bool = False
    mutated: bool = False
    stats: Any = None
    scaler_updated: bool = False
    scheduled: bool = False

    @property
    def began(self) -> bool:
        """The optimizer's step raised or returned: the window must not be run again."""
        return self.optimizer_raised or self.stats is not None


def refuse_work_while_step_unfinished(progress: StepProgress, what: str, window: int, *, fix: str) -> None:
    """UsageError when ``what`` (a backward, a new window) comes while the window's step is unfinished."""
    if progress.began:
        raise UsageError(f"{what} while window {window}'s step() is unfinished: {fix}")


def refuse_retry(progress: StepProgress, window: int, *, drop: str) -> None:
    """UsageError when a retried step could not be exact; ``drop`` names the call that drops the window."""
    if progress.mutated:
        raise UsageError(
            f"step() again after window {window}'s optimizer step raised having already changed "
            "parameters or optimizer state: a retry would apply part of the step twice. Restore model "
            f"and optimizer from a checkpoint, then call {drop}"
        )
    if progress.scaling_failed:
        raise UsageError(
            f"step() again after window {window}'s step() raised while unscaling or normalising "
            "its gradients: they are partly scaled, so a retry would not be exact. Nothing was stepped: "
            f"drop the window with {drop}"
        )


def optimizer_fingerprint(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(state entries, summed version counters) of the parameters and the optimizer state: both only grow.

    Every in-place write to a tensor (p.add_, a foreach op, ``state["step"] += 1``) bumps its
    ``_version``, and state created for a parameter adds entries. A kernel that writes without
    bumping versions (fused AdamW) still bumps its step counters first, so it is caught too.
    """
    entries = versions = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            versions += p._version
            per_parameter: Any = optimizer.state.get(p)
            if per_parameter:
                entries += len(per_parameter)
                versions += sum(v._version for v in per_parameter.values() if isinstance(v, torch.Tensor))
    return entries, versions


def guarded_optimizer_step(
    progress: StepProgress,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    *,
    on_raise: Callable[[], Any] | None = None,
) -> None:
    """``step()`` (the optimizer's step, however it is made); if it raises, ``on_raise()`` (put the
    gradients back) and record in ``progress`` that the step began and whether it changed anything."""
    before = optimizer_fingerprint(optimizer)
    try:
        step()
    except BaseException:
        mutated = optimizer_fingerprint(optimizer) != before
        if on_raise is not None:
            on_raise()
        progress.optimizer_raised = True
        progress.mutated = progress.mutated or mutated
        raise


def require_items(total_items: float, what: str) -> None:
    """The items > 0 rule for a window: items summed over every micro-batch and rank."""
    if total_items <= 0:
        raise UsageError(f"{what} on a window without items on any rank: there is no gradient to apply")


def refuse_option(name: str, value: object, where: str, fix: str) -> None:
    """ConfigError: ``where`` cannot honour ``name=value``; ``fix`` says what to do instead."""
    raise ConfigError(f"{where} does not honour {name}={value!r}: {fix}")
