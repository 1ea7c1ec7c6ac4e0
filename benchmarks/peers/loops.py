"""Running any peer's loop by name (``train``), and timing it on a fresh model copy (``Runner``)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from .accelerate_peer import loop_accelerate
from .hf_trainer_peer import loop_hf_trainer
from .lightning_peer import loop_lightning
from .microbatch_peer import loop_microbatch
from .nanogpt_peer import loop_nanogpt
from .protocol import adamw, lm_loss, seconds_per_step, step_times

LOOPS = {"microbatch": loop_microbatch, "accelerate": loop_accelerate, "nanogpt": loop_nanogpt}


OWN_OPTIMIZER_LOOPS = {
    "lightning": loop_lightning,
    "hf_trainer": loop_hf_trainer,
    "hf_trainer_mean": functools.partial(loop_hf_trainer, takes_count=False),
}


def train(
    loop: str,
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], Any],
    micro_batches: list[Any],
    **kw: Any,
) -> None:
    """Run ``loop``: a key of LOOPS, or of OWN_OPTIMIZER_LOOPS (those call make_optimizer themselves)."""
    if loop in OWN_OPTIMIZER_LOOPS:
        OWN_OPTIMIZER_LOOPS[loop](model, make_optimizer, micro_batches, **kw)
    else:
        LOOPS[loop](model, make_optimizer(model), micro_batches, **kw)


@dataclass(frozen=True)
class Runner:
    """A loop (a key of LOOPS or "lightning"), and what is done to a fresh model copy first."""

    loop: str
    prepare: Callable[[nn.Module], Any] | None = None

    def seconds_per_step(self, base: nn.Module, micro_batches: list[Any], *, steps: int) -> dict[str, float]:
        model = copy.deepcopy(base)
        model.train()
        if self.prepare is not None:
            self.prepare(model)
        with step_times() as times:
            train(self.loop, model, adamw, micro_batches, loss=lm_loss, steps=steps, max_grad_norm=1.0)
        return seconds_per_step(times)
