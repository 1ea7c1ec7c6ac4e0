"""Predicting a pipeline's per-stage peak memory and step time from one process.

The model is cut as the Pipeline cuts it (torch's tracer, the same split points), and each stage
runs one micro-batch on this process alone under a MemoryTracker: its input, its forward (the last
stage with the loss), the backward of a unit output gradient. That gives, per stage s:

    one_bytes_s    the peak of that micro-batch: parameters, gradients, activations, temporaries
    kept_bytes_s   what the forward leaves alive until its backward (saved activations, output)
    seconds_s      forward + backward, on this thread's CPU clock

A schedule keeps k_s micro-batches in flight on stage s at its fullest moment: GPipe all m (every
forward before any backward); 1F1B min(m, S - s) (stage s runs S - s forwards before its first
backward, then one forward per backward; Narayanan et al. 2021, PipeDream-Flush). So

    peak_s = max(one_bytes_s + (k_s - 1) * kept_bytes_s,              the oldest one's backward
                 start_s + gradients_s + (k_s - 1) * kept_bytes_s + forward_s)   a forward (m > k_s)
             + optimizer_s + buffers_s

(the second: once m > k_s, a forward runs after the first backward, when every gradient exists;
forward_s is that forward's own peak, start_s the parameters and input before it)

with buffers_s the m - 1 further receive buffers torch's stage allocates for the activations
(s > 0) and gradients (s < S - 1) of every micro-batch. The step takes about
(m + S - 1) * max_s seconds_s: m micro-batches through the slowest stage plus the S - 1 steps
of filling and draining (the bubble, a fraction (S - 1) / (m + S - 1) of the step).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..distributed.stage_grads import used_parameter_names
from ..distributed.stages import stage_starts
from ..errors import ConfigError, InfeasibleBudgetError
from ..memory import MemoryTracker


@dataclass(frozen=True)
class StageCost:
    """One micro-batch on one stage, measured alone (see the module docstring)."""

    one_bytes: int
    kept_bytes: int
    start_bytes: int  # parameters and input, before the forward
    forward_bytes: int  # the forward's own peak above start_bytes (kept bytes and temporaries)
    parameter_bytes: int
    input_bytes: int
    output_bytes: int  # what it sends on (0 for the last stage)
    result_bytes: int  # the last stage's output (logits): torch's loop keeps one past its backward
    seconds: float


@dataclass(frozen=True)
class PipelinePrediction:
    schedule: str
    micro_batches: int
    in_flight: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    seconds_per_step: float
    bubble_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def in_flight(schedule: str, num_stages: int, micro_batches: int) -> tuple[int, ...]:
    """Micro-batches whose activations stage s holds at once (see the module docstring)."""
    if schedule == "gpipe":
        return tuple(micro_batches for _ in range(num_stages))
    if schedule == "1f1b":
        return tuple(min(micro_batches, num_stages - s) for s in range(num_stages))
    raise ConfigError(f"schedule must be gpipe or 1f1b for a prediction, got {schedule!r}")


def _tensor_bytes(value: Any) -> int:
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _run_stage(
    module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None, loss_fn: Callable[..., Any]
) -> tuple[StageCost, torch.Tensor]:
    """One micro-batch through ``module`` alone; its cost and its output (the next stage's input)."""
    used = used_parameter_names(module)
    parameters = [p for n, p in module.named_parameters(remove_duplicate=False) if n in used]
    inputs = inputs.detach().requires_grad_(inputs.is_floating_point())
    with MemoryTracker(inputs.device) as tracker:
        tracker.track(parameters, category="parameters")
        tracker.track(inputs, category="other")
        before = tracker.current_bytes
        output = module(inputs)
        target = loss_fn(output, labels)[0] if labels is not None else output
        kept = tracker.current_bytes - before
        forward_peak = tracker.peak_bytes - before
        gradient = None if labels is not None else torch.ones_like(output)
        torch.autograd.backward(target, gradient)
    # Timed outside the tracker (a dispatch mode slows every operation down).
    started = time.thread_time()
    timed = module(inputs)
    torch.autograd.backward(loss_fn(timed, labels)[0] if labels is not None else timed, gradient)
    seconds = time.thread_time() - started
    for p in parameters:
        p.grad = None
    cost = StageCost(
        one_bytes=int(tracker.peak_bytes),
        kept_bytes=int(kept),
        start_bytes=int(before),
        forward_bytes=int(forward_peak),
        parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
        input_bytes=_tensor_bytes(inputs) if inputs.is_floating_point() else 0,
        output_bytes=_tensor_bytes(output) if labels is None else 0,
        result_bytes=_tensor_bytes(output) if labels is not None else 0,
        seconds=seconds,
    )
    return cost, output.detach()


def profile_stages(
    model: nn.Module,
    *,
    num_stages: int,
    example: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[..., Any],
    blocks: Sequence[str] | str = "auto",
    rounds: int = 3,
) -> list[StageCost]:
    """Each stage's cost for one micro-batch (``example``, ``labels``), on this process alone.

    Times are the fastest of ``rounds``; bytes are the last round's (the same every round).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    starts = stage_starts(model, num_stages, blocks)
    # Traced on a copy: torch's tracer leaves a model it cannot trace a second time.
    pipe = pipeline(
        copy.deepcopy(model), mb_args=(example,), split_spec={name: SplitPoint.BEGINNING for name in starts}
    )
    modules = [pipe.get_stage_module(s) for s in range(num_stages)]
    best: list[StageCost] = []
    for _ in range(max(1, rounds)):
        current, costs = example, []
        for s, module in enumerate(modules):
            cost, current = _run_stage(module, current, labels if s == num_stages - 1 else None, loss_fn)
            costs.append(cost)
        best = (
            costs
            if not best
            else [
                StageCost(**{**asdict(c), "seconds": min(c.seconds, b.seconds)})
                for c, b in zip(costs, best, strict=True)
            ]
        )
    return best


def predict_pipeline(
    costs: Sequence[StageCost],
    *,
    micro_batches: int,
    schedule: str,
    optimizer_state_per_parameter_byte: float = 0.0,
) -> PipelinePrediction:
    """Per-stage peaks and step time of ``micro_batches`` per step under ``schedule``.

    ``optimizer_state_per_parameter_byte``: 2 for Adam(W) (two moments of each parameter), 0 for
    plain SGD or a window measured before the optimizer's first step.
    """
    count = len(costs)
    flight = in_flight(schedule, count, micro_batches)
    peaks = []
    for s, cost in enumerate(costs):
        buffers = (micro_batches - 1) * (cost.input_bytes + cost.output_bytes)
        optimizer = optimizer_state_per_parameter_byte * cost.parameter_bytes
        held = (flight[s] - 1) * cost.kept_bytes
        backward = cost.one_bytes + held  # the oldest micro-batch's backward, k - 1 others held
        # With m > k a forward follows the first backward: every gradient exists by then.
        # The schedule's loop variable still holds the previous micro-batch's output there (the
        # last stage's logits; on other stages that output is among the held ones anyway).
        forward = cost.start_bytes + cost.parameter_bytes + held + cost.forward_bytes + cost.result_bytes
        moment = max(backward, forward) if micro_batches > flight[s] else backward
        peaks.append(int(moment + buffers + optimizer))
    slowest = max(cost.seconds for cost in costs)
    return PipelinePrediction(
        schedule=schedule,
        micro_batches=micro_batches,
        in_flight=flight,
        peak_bytes=tuple(peaks),
        seconds_per_step=(micro_batches + count - 1) * slowest,
        bubble_fraction=(count - 1) / (micro_batches + count - 1),
    )


# ---------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class PipelineChoice:
    """The chosen split of one replica's batch: micro-batches of ``micro_batch_size`` rows,
    ``micro_batches`` of them per step under ``schedule``, with its prediction; ``considered`` holds
    every (micro-batch size, schedule, predicted worst stage peak, predicted seconds) tried."""

    micro_batch_size: int
    micro_batches: int
    schedule: str
    stage_starts: tuple[str, ...]
    prediction: PipelinePrediction
    considered: tuple[tuple[int, str, int, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_pipeline(
    model: nn.Module,
    *,
    num_stages: int,
    rows: int,
    budget_bytes: int,
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[..., Any],
    schedules: Sequence[str] = ("1f1b", "gpipe"),
    micro_batch_sizes: Sequence[int] | None = None,
    optimizer_state_per_parameter_byte: float = 2.0,
    blocks: Sequence[str] | str = "auto",
) -> PipelineChoice:
    """The fastest predicted (micro-batch size, schedule) whose every stage fits ``budget_bytes``.

    ``rows``: one replica's batch per optimizer step; each size b gives m = ceil(rows / b) micro-batches
    (the last one padded). Sizes default to the powers of two up to ``rows``. Ties in time go to the
    smaller peak. No fit: InfeasibleBudgetError with the least peak found.
    """
    sizes = list(micro_batch_sizes or [b for b in (2**i for i in range(rows.bit_length())) if b <= rows])
    starts = tuple(stage_starts(model, num_stages, blocks))
    considered, best = [], None
    for size in sizes:
        tokens, labels = make_batch(size)
        costs = profile_stages(
            model, num_stages=num_stages, example=tokens, labels=labels, loss_fn=loss_fn, blocks=list(starts)
        )
        count = -(-rows // size)
        for schedule in schedules:
            guess = predict_pipeline(
                costs,
                micro_batches=count,
                schedule=schedule,
                optimizer_state_per_parameter_byte=optimizer_state_per_parameter_byte,
            )
            worst = max(guess.peak_bytes)
            considered.append((size, schedule, worst, guess.seconds_per_step))
            key = (guess.seconds_per_step, worst)
            if worst <= budget_bytes and (best is None or key < best[0]):
                best = (key, size, count, schedule, guess)
    if best is None:
        least = min(worst for _, _, worst, _ in considered)
        raise InfeasibleBudgetError(
            f"no pipeline split of {rows} rows over {num_stages} stages fits {budget_bytes} bytes per rank; "
            f"the least predicted stage peak is {least} bytes: more stages, a smaller model or more memory",
            minimum_bytes=least,
        )
    _, size, count, schedule, guess = best
    return PipelineChoice(size, count, schedule, starts, guess, tuple(considered))
