"""plan.apply(ddp_model, optimizer): the blocks inside the DDP wrapper are checkpointed (the names
carry no ``module.``), the Accumulator uses no_sync (one all-reduce per window, not per micro-batch),
and the gradient is the full batch's (float64, rtol 1e-9 / atol 1e-12)."""

from __future__ import annotations

import plan_workers as w
import pytest
import torch

import microbatch as mb
from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WINDOWS = 3
TOL = {"rtol": 1e-9, "atol": 1e-12}


def test_a_plan_applies_to_the_ddp_wrapper() -> None:
    policies = {f"blocks.{i}": "full" for i in range(w.BLOCKS)}
    plan = mb.Plan.manual(batch_size=20, micro_batch_size=4, world_size=2, policies=policies)
    runs = launch(w.ddp_plan, plan.to_dict(), WINDOWS, world_size=2, timeout_s=180.0)
    sizes = list(plan.micro_batch_sizes)
    for run in runs:
        assert run["checkpointed"] == [True] * w.BLOCKS and run["removed"]
        # One bucket here (a small model): one all-reduce per window means no_sync covered the rest.
        assert run["reduces"] == [1] * WINDOWS
        for window, grads in enumerate(run["grads"]):
            for name, value in w.reference_grads(window, sizes, world_size=2).items():
                torch.testing.assert_close(grads[name], value, **TOL)
