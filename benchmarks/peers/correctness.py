"""Part 1, correctness: the gradient each tool hands its optimizer against the full batch's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from microbatch.models.workloads import VarlenTokens

from .loops import train
from .protocol import (
    TOOLS,
    Case,
    Grads,
    concat,
    grads_of,
    lm_loss,
    max_relative_error,
    mlp,
    mse_loss,
    regression_batches,
    tiny_lm,
)


def correctness_cases() -> dict[str, Case]:
    tokens = VarlenTokens(block_size=32, min_length=2, seed=3)
    return {
        "equal": Case(mlp, regression_batches(4, 8), 4, mse_loss),
        "varlen": Case(tiny_lm, tuple(tokens(4) for _ in range(4)), 4, lm_loss),
        "partial": Case(mlp, regression_batches(7, 4), 4, mse_loss),
        "clip": Case(mlp, regression_batches(4, 8), 4, mse_loss, clip_fraction=0.25),
    }


def reference_grads(case: Case) -> tuple[Grads, float | None]:
    """The last window's full-batch gradient, clipped as a full-batch step would clip it."""
    model = case.make_model()
    case.loss(model, concat(case.last_window))[0].backward()
    max_grad_norm = None
    if case.clip_fraction is not None:
        norm = float(nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        max_grad_norm = case.clip_fraction * norm
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return grads_of(model), max_grad_norm


class RecordingSGD(torch.optim.SGD):
    """SGD with lr=0 that records the gradients it is handed, after running the step's closure.

    Lightning computes a window's last micro-batch and clips inside ``optimizer.step(closure)``, so
    a step pre-hook would fire too early; recording after the closure works for every tool.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.model = model
        self.recorded: list[Grads] = []

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.recorded.append(grads_of(self.model))
        super().step()
        return loss


def last_step_grads(tool: str, case: Case, max_grad_norm: float | None) -> Grads | None:
    """The gradients ``tool`` hands its optimizer at its last step; None where the case cannot arise."""
    if tool == "nanogpt" and len(case.micro_batches) % case.steps:
        return None  # it samples whole windows forever: there is no partial last window
    model = case.make_model()
    made: list[RecordingSGD] = []

    def make_optimizer(m: nn.Module) -> RecordingSGD:
        made.append(RecordingSGD(m))
        return made[-1]

    train(
        tool, model, make_optimizer, list(case.micro_batches),
        loss=case.loss, steps=case.steps, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    return made[-1].recorded[-1] if made and made[-1].recorded else {}


def run_correctness(tools: Sequence[str] = tuple(TOOLS)) -> dict[str, dict[str, float | None]]:
    """tool -> case -> max relative gradient error against the full batch (None: does not arise)."""
    errors: dict[str, dict[str, float | None]] = {tool: {} for tool in tools}
    for key, case in correctness_cases().items():
        expected, max_grad_norm = reference_grads(case)
        for tool in tools:
            actual = last_step_grads(tool, case, max_grad_norm)
            errors[tool][key] = None if actual is None else max_relative_error(actual, expected)
    return errors
