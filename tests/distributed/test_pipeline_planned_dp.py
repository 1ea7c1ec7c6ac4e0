"""mb.plan(..., pipeline=2, world_size=4) on 4 gloo ranks: 2 data-parallel replicas x 2 stages.

Every rank proves its own stage in the trial; each stage's peak (its worse replica) is within the
budget and within 10 % of the prediction; the plan's pipeline gives every rank its share of the
full-batch gradient of both replicas' windows (float64, rtol 1e-9 as test_pipeline.py).
"""

from __future__ import annotations

import planned_pipeline_workers as w
import pytest
import torch
from test_pipeline import TOL

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BUDGETS = ["64MiB", "1.4MiB"]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.four_ranks, BUDGETS, world_size=4, timeout_s=900.0)


def test_replicas_and_stages_are_laid_out_replica_major(runs: list[dict]) -> None:
    assert [(r["stages"], r["replica"]) for r in runs] == [([0], 0), ([1], 0), ([0], 1), ([1], 1)]


def test_every_stage_within_budget_and_ten_percent(runs: list[dict]) -> None:
    for result in runs[0]["results"]:
        plan = result["plan"]
        assert plan["world_size"] == 2 and plan["pipeline_stages"] == 2  # replicas x stages
        pairs = zip(plan["stage_peak_bytes"], plan["measured_stage_peak_bytes"], strict=True)
        for predicted, measured in pairs:
            assert measured <= plan["budget_bytes"]
            assert abs(predicted - measured) / measured < 0.10, plan
    roomy, tight = (r["plan"] for r in runs[0]["results"])
    assert max(tight["stage_peak_bytes"]) < max(roomy["stage_peak_bytes"])


def test_every_rank_holds_its_share_of_the_global_full_batch_gradient(runs: list[dict]) -> None:
    for index, result in enumerate(runs[0]["results"]):
        expected = w.reference(result["plan"]["micro_batch_sizes"], replicas=2)
        for rank_run in runs:
            for name, grad in rank_run["results"][index]["grads"].items():
                torch.testing.assert_close(grad, expected[name], **TOL)
