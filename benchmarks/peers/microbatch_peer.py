"""microbatch: the Accumulator loop, and under a budget the planner."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import microbatch as mb
from microbatch.errors import MicrobatchError
from microbatch.models.workloads import VarlenTokens

from .protocol import Mechanism, adamw, lm_loss
from .simulated_budget import SimulatedBudget


def loop_microbatch(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    acc = mb.Accumulator(model, optimizer, steps=kw["steps"], max_grad_norm=kw["max_grad_norm"])
    for micro in acc.iterate(micro_batches):
        loss, items = kw["loss"](model, micro.batch)
        acc.backward(loss, items=items)  # loss is a mean over `items` samples or tokens
        if micro.is_last:
            acc.step()


def microbatch_plan(budget: SimulatedBudget, batch: int) -> tuple[Mechanism, Any]:
    """microbatch's planner for the same batch and budget; its own trial window proves the fit."""
    from .loops import Runner  # loops runs every peer's loop, this one's included

    row = Mechanism("microbatch-plan", "microbatch `plan(batch, memory=budget)`")
    setup = budget.setup
    workload = mb.Workload(
        model=copy.deepcopy(budget.base),
        make_batch=VarlenTokens(block_size=setup.block_size, min_length=setup.block_size // 4, seed=11),
        loss=lm_loss,
        optimizer=adamw,
        name="gpt2",
    )
    try:
        chosen = mb.plan(
            workload, batch=batch, memory=budget.budget_bytes, max_profile_micro_batch_size=setup.profile_max
        )
    except MicrobatchError as error:
        return replace(row, note=f"no plan: {error}"), None
    except Exception as error:  # the planner failing is a result to show, not a reason to lose the rest
        return replace(row, note=f"the planner failed: {error!r}"), None
    checkpointed = [policy for _, policy in chosen.block_policies if policy != "none"]
    kinds = ", ".join(sorted(set(checkpointed)))
    row = replace(
        row,
        micro_batch_size=chosen.micro_batch_size,
        steps=chosen.steps,
        effective_batch=sum(chosen.micro_batch_sizes),
        peak_bytes=chosen.measured_peak_bytes,
        checkpointing=f"{kinds}: {len(checkpointed)} of {len(chosen.block_policies)} blocks"
        if checkpointed
        else "none",
        note=f"peak from the plan's own trial; planning took {chosen.planning_seconds:.1f} s",
    )
    return row, Runner("microbatch", chosen.checkpoint)
