"""Part 3, a smaller memory budget: each tool's own mechanism finds what fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from microbatch.trees.batches import micro_batch_sizes, split_batch

from .accelerate_peer import accelerate_finder
from .lightning_peer import lightning_finder
from .loops import Runner
from .microbatch_peer import microbatch_plan
from .protocol import Mechanism, Setup, gpt2, hf_checkpoint_every_layer, token_batches
from .simulated_budget import SimulatedBudget
from .speed import interleaved


def run_budget(setup: Setup) -> dict[str, Any]:
    """The recipe (micro-batch x steps) under a budget that fits micro-batches ``shrink`` x smaller."""
    base = gpt2(setup)
    batch = setup.batch_size
    recipe_micro, recipe_steps = 2 * setup.micro_batch_size, setup.steps // 2
    budget = SimulatedBudget(setup, base)
    budget.budget_bytes = int(budget.peak_bytes(recipe_micro // setup.shrink) * 1.01)
    rows: list[Mechanism] = []
    runners: dict[str, Runner] = {}

    def add(row: Mechanism, runner: Runner | None, *, hf_checkpoint: bool = False) -> None:
        if row.micro_batch_size is not None and row.peak_bytes is None:
            peak_bytes = budget.peak_bytes(row.micro_batch_size, hf_checkpoint=hf_checkpoint)
            row = replace(row, peak_bytes=peak_bytes)
        if runner is not None:
            runners[row.key] = runner
        rows.append(row)

    add(
        Mechanism("unconstrained", "hand-written loop, whole batch at once, no budget", batch, 1, batch),
        Runner("nanogpt"),
    )
    if budget.fits(recipe_micro):
        add(
            Mechanism("nanogpt", "nanoGPT-style loop, recipe as written", recipe_micro, recipe_steps, batch),
            Runner("nanogpt"),
        )
    else:
        add(
            Mechanism(
                "nanogpt", "nanoGPT-style loop, recipe as written", note="no mechanism: runs out of memory"
            ),
            None,
        )

    found = accelerate_finder(recipe_micro, budget.fits)
    add(
        Mechanism(
            "accelerate",
            "Accelerate `find_executable_batch_size`, steps unchanged (its docstring)",
            found,
            recipe_steps,
            found * recipe_steps,
        ),
        Runner("accelerate"),
    )
    kept = max(1, batch // found)
    add(
        Mechanism(
            "accelerate-example",
            "Accelerate `find_executable_batch_size`, steps = batch // found (its example script)",
            found,
            kept,
            found * kept,
            note="the user's own code recomputes the steps",
        ),
        Runner("accelerate"),
    )

    hf_found = accelerate_finder(recipe_micro, lambda size: budget.fits(size, hf_checkpoint=True))
    add(
        Mechanism(
            "hf-checkpoint",
            "transformers gradient checkpointing (every layer) + `auto_find_batch_size`",
            hf_found,
            recipe_steps,
            hf_found * recipe_steps,
            "every layer",
            note="as `TrainingArguments(gradient_checkpointing=True, auto_find_batch_size=True)`",
        ),
        Runner("nanogpt", hf_checkpoint_every_layer),
        hf_checkpoint=True,
    )

    try:
        found_l = lightning_finder(budget, recipe_micro, recipe_steps)
        add(
            Mechanism(
                "lightning",
                "Lightning `Tuner.scale_batch_size` (binsearch), accumulate_grad_batches unchanged",
                found_l,
                recipe_steps,
                found_l * recipe_steps,
                note="binary search, then its default 5 % safety margin",
            ),
            Runner("lightning"),
        )
    except Exception as error:  # a peer's own code failing is a result to report, not a crash
        add(Mechanism("lightning", "Lightning `Tuner.scale_batch_size`", note=f"failed: {error!r}"), None)

    add(*microbatch_plan(budget, batch))

    def run_of(row: Mechanism, runner: Runner) -> Callable[[], dict[str, float]]:
        total = row.effective_batch or 0
        sizes = micro_batch_sizes(total, row.micro_batch_size or total)
        windows = token_batches(setup, setup.timed_steps + 1, total, seed=7)
        micro = [part for window in windows for part in split_batch(window, sizes)]
        return lambda: runner.seconds_per_step(base, micro, steps=len(sizes))

    runs = {row.key: run_of(row, runners[row.key]) for row in rows if row.key in runners}
    timings = interleaved(runs, rounds=setup.rounds, baseline="unconstrained")
    rows = [
        replace(
            row,
            seconds_per_step=timings[row.key]["seconds_per_step"],
            cpu_seconds_per_step=timings[row.key]["cpu_seconds_per_step"],
        )
        if row.key in timings
        else row
        for row in rows
    ]
    return {
        "batch_size": batch,
        "recipe": {"micro_batch_size": recipe_micro, "steps": recipe_steps},
        "budget_bytes": budget.budget_bytes,
        "rows": [row.to_dict() for row in rows],
    }
