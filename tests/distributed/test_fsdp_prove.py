"""Per-rank proof of a sharded plan: planner.prove on every FSDP2 rank, each within the budget.

A plan made with mb.plan(..., world_size=2, shard="fsdp") is predicted in the process that made it.
On 2 gloo ranks, each shards the 4-block MLP with fully_shard and calls prove(plan, workload):
both run the trial window in the plan's gradient sync mode, gather their peaks, and agree on the
largest; a copy of the plan whose budget is one byte below that peak is refused on both ranks. The
same plan then trains 3 windows under a tracker opened outside the plan, as a referee.
"""

from __future__ import annotations

import plan_workers as w
import pytest

import microbatch as mb
from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCH = 512
BUDGET = "640KB"
WINDOWS = 3
MODES = ("window", "micro-batch")


@pytest.fixture(scope="module")
def planned() -> dict[str, mb.Plan]:
    return {
        mode: mb.plan(
            w.workload(), batch=BATCH, memory=BUDGET, world_size=2, shard="fsdp", gradient_sync=mode
        )
        for mode in MODES
    }


@pytest.fixture(scope="module")
def proofs(planned: dict[str, mb.Plan]) -> list[dict[str, dict]]:
    plans = {mode: plan.to_dict() for mode, plan in planned.items()}
    return launch(w.prove_plans, plans, WINDOWS, world_size=2, timeout_s=240.0)


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_proves_the_sharded_plan_within_its_budget(
    planned: dict[str, mb.Plan], proofs: list[dict[str, dict]], mode: str
) -> None:
    plan = planned[mode]
    assert plan.measured_peak_bytes is None  # made in one process: predicted only
    measured = [rank[mode]["measured"] for rank in proofs]
    assert measured[0] == measured[1] and 0 < measured[0] <= plan.budget_bytes  # the larger rank's
    for rank in proofs:
        assert any(
            note.startswith("proved on 2 ranks, each within the budget") for note in rank[mode]["notes"]
        )
        # The referee: the trial window's peak is what the training windows reach on that rank.
        training = rank[mode]["training"]
        assert len(training) == WINDOWS and max(training) <= plan.budget_bytes
        # The trial's peak is near the training windows' but not equal: gloo's reduce-scatters run on
        # their own thread, so how many micro-batches' buffers are still held when the next forward
        # starts depends on timing (one plan's windows spread 468-634 KB on this 2-core machine, its
        # trial read 568 KB). The prediction counts them held, and bounds every window (634,586 B
        # predicted for that 634,488 B window).
        assert 0.75 * max(training) <= measured[0] <= 1.1 * max(training), (measured, training)
        assert max(training) <= plan.predicted_peak_bytes, (training, plan.predicted_peak_bytes)


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_below_a_ranks_peak_is_refused_on_every_rank(
    proofs: list[dict[str, dict]], mode: str
) -> None:
    for rank in proofs:
        refused = rank[mode]["refused"]
        assert "measured a peak over its budget" in refused and "rank " in refused, refused
