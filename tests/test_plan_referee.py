"""The outside referee: a plan trained for several windows stays within its budget in every one.

The planner's own tests read ``measured_peak_bytes``, the number the planner accepted. Here each
plan is applied with the options it was made with and trained for WINDOWS windows, every window
under a MemoryTracker opened outside the plan (each micro-batch handed over when its turn comes
and dropped after it, as a loader does), and every window's peak is held to the budget: four models
at tight budgets, one in bfloat16 with accumulate_dtype=float32, one stepped by a GradScaler, one
with BatchNorm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import cnn_bn, gpt_workload
from microbatch.planner.search.sizes import search
from microbatch.planner.target.sharding import with_wide_gradients
from microbatch.profile import Profile, profile_workload
from microbatch.workload import Workload

WINDOWS = 5
FRACTIONS = (0.15, 0.5)  # of the way from the smallest plan's peak to one micro-batch of the batch


def bf16_gpt() -> Workload:
    workload = gpt_workload(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=32), max_bytes=200_000)
    workload.model.to(torch.bfloat16)
    return workload


def fp32_gpt() -> Workload:
    return gpt_workload(GPTConfig(n_layer=3, n_head=2, n_embd=48, block_size=32), max_bytes=200_000)


def mlp() -> Workload:
    torch.manual_seed(3)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(96, 96), nn.GELU()) for _ in range(4)), nn.Linear(96, 1))

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 96), torch.randn(size, 1)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return nn.functional.mse_loss(m(batch[0]), batch[1]), len(batch[1])

    return Workload(model, make_batch, loss, lambda m: torch.optim.Adam(m.parameters()), name="mlp")


# (workload factory, batch, plan options, what apply() gets beyond them)
CASES: dict[str, tuple[Callable[[], Workload], int, dict[str, Any], Callable[[], dict[str, Any]]]] = {
    "bf16 gpt, float32 sums": (bf16_gpt, 24, {"accumulate_dtype": torch.float32}, dict),
    "fp32 gpt": (fp32_gpt, 24, {}, dict),
    "mlp, GradScaler": (mlp, 96, {"scaler": True}, lambda: {"scaler": torch.amp.GradScaler("cpu")}),
    "cnn with BatchNorm": (cnn_bn, 24, {"min_micro_batch_size": 2}, dict),
}


def budgets(workload: Workload, profile: Profile, batch: int, options: dict[str, Any]) -> list[int]:
    widened = with_wide_gradients(profile, workload.model, options.get("accumulate_dtype"))
    floor = options.get("min_micro_batch_size", 1)
    result = search(widened, per_rank_batch=batch, capacity_bytes=math.inf, min_micro_batch_size=floor)
    low = result.minimum.peak_bytes
    # One micro-batch of the whole batch, whatever the timings: the frontier of all plans keeps only
    # points no other is both faster and smaller than, and under a loaded CPU's timing noise it can
    # lose the large ones, leaving a range too narrow for a trial's few bytes of excess.
    whole = search(widened, per_rank_batch=batch, capacity_bytes=math.inf, min_micro_batch_size=batch)
    top = max(point.peak_bytes for point in whole.frontier)
    return [int(low + fraction * (top - low)) for fraction in FRACTIONS]


def _fed(window: list[Any]) -> Iterator[Any]:
    """Each micro-batch handed over when its turn comes and dropped after it, as a loader does.

    They are made before the tracker opens: making one reads the corpus, which is no training memory.
    """
    while window:
        yield window.pop(0)


def referee_peaks(workload: Workload, plan: mb.Plan, apply_options: dict[str, Any]) -> list[int]:
    """Every window's peak, by a tracker that is none of the planner's."""
    model = workload.model
    optimizer = workload.make_optimizer()
    accumulator = plan.apply(model, optimizer, **apply_options)
    peaks = []
    try:
        for _ in range(WINDOWS):
            window = [workload.make_batch(size) for size in plan.micro_batch_sizes]
            with mb.MemoryTracker(torch.device("cpu"), model=model, optimizer=optimizer) as tracker:
                for micro in accumulator.iterate(_fed(window)):
                    loss, items = workload.loss(model, micro.batch)
                    accumulator.backward(loss, items=items)
                    del loss
                    if micro.is_last:
                        accumulator.step()
            peaks.append(tracker.peak_bytes)
    finally:
        plan.remove(model)
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_every_window_of_a_tight_plan_stays_within_the_budget(case: str) -> None:
    factory, batch, options, apply_extra = CASES[case]
    workload = factory()
    floor = options.get("min_micro_batch_size", 1)
    sizes = tuple(sorted({floor, 4, 8})) if floor > 1 else None
    profile = profile_workload(workload, max_micro_batch_size=8, repeats=1, micro_batch_sizes=sizes)
    for budget in budgets(workload, profile, batch, options):
        plan = mb.plan(workload, batch=batch, memory=budget, profile=profile, **options)
        assert (plan.accumulate_dtype, plan.scaler) == (
            "float32" if "accumulate_dtype" in options else None,
            bool(options.get("scaler")),
        )
        peaks = referee_peaks(workload, plan, apply_extra())
        assert len(peaks) == WINDOWS
        assert max(peaks) <= budget, (case, budget, peaks, str(plan))
