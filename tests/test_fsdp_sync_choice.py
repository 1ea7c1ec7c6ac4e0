"""FSDP2's gradient sync as a planned choice: the per-rank profile of each mode, and the choice."""

from __future__ import annotations

import math

import pytest

import microbatch as mb
from microbatch.memory.device_specs import devices
from microbatch.planner.search.rules import SplitRules
from microbatch.planner.search.sizes import search
from microbatch.planner.target.per_rank import SHARDED_STEP, UNSHARDED_GRADIENTS, shard_profile
from microbatch.planner.target.sharding import rank_profile
from microbatch.profile.simulate import simulate_profile
from microbatch.workload import load_workload

W = 4
pytestmark = pytest.mark.slow  # simulated profiles of gpt-mini and one real profile: minutes on 2 cores


@pytest.fixture(scope="module")
def simulated() -> tuple[mb.Workload, mb.Profile]:
    workload = load_workload("gpt-mini")
    return workload, simulate_profile(
        workload, devices()["l4"], micro_batch_sizes=[1, 2, 4], policies=["none"]
    )


def test_sync_once_holds_unsharded_gradients_and_scatters_once(
    simulated: tuple[mb.Workload, mb.Profile],
) -> None:
    workload, profile = simulated
    spec = devices()["l4"]
    once, _ = shard_profile(
        profile, workload.model, shard="fsdp", world_size=W, spec=spec, gradient_sync="window"
    )
    every, _ = shard_profile(
        profile, workload.model, shard="fsdp", world_size=W, spec=spec, gradient_sync="micro-batch"
    )
    assert once.gradient_bytes == profile.gradient_bytes  # every rank: the whole model's gradients
    assert once.static_parts()[UNSHARDED_GRADIENTS] == profile.gradient_bytes
    assert every.gradient_bytes == math.ceil(profile.gradient_bytes / W)
    assert [s.gradient_bytes for s in once.segments] == [s.gradient_bytes for s in profile.segments]
    # One reduce-scatter of G per step, (W - 1) / W G / link, instead of one per micro-batch.
    scatter = (W - 1) / W * profile.gradient_bytes / spec.interconnect_bytes_per_second
    assert once.step_seconds - every.step_seconds == pytest.approx(scatter)
    assert every.loop_seconds.intercept - once.loop_seconds.intercept == pytest.approx(scatter)


def test_the_choice_is_the_faster_plan_that_fits(simulated: tuple[mb.Workload, mb.Profile]) -> None:
    workload, profile = simulated
    options = {
        "shard": "fsdp",
        "world_size": W,
        "spec": devices()["l4"],
        "rules": SplitRules(),
        "bytes_per_sample": 0,
    }
    batch = 32
    fits = {}
    for mode in ("window", "micro-batch"):
        changed, _ = shard_profile(
            profile, workload.model, shard="fsdp", world_size=W, spec=options["spec"], gradient_sync=mode
        )
        fits[mode] = search(changed, per_rank_batch=batch, capacity_bytes=math.inf).minimum.peak_bytes
    assert fits["window"] > fits["micro-batch"]
    # A budget only sharded gradients fit: reduce-scatter every micro-batch.
    tight = (fits["window"] + fits["micro-batch"]) // 2
    _, _, mode = rank_profile(
        profile, workload.model, gradient_sync=None, per_rank_batch=batch, capacity_bytes=tight, **options
    )
    assert mode == "micro-batch"
    # Room for anything: the same split either way, one reduce-scatter per window is faster.
    _, _, mode = rank_profile(
        profile, workload.model, gradient_sync=None, per_rank_batch=batch, capacity_bytes=math.inf, **options
    )
    chosen, _, _ = rank_profile(
        profile,
        workload.model,
        gradient_sync="window",
        per_rank_batch=batch,
        capacity_bytes=math.inf,
        **options,
    )
    best = search(chosen, per_rank_batch=batch, capacity_bytes=math.inf).best
    assert best is not None
    assert mode == ("window" if best.steps > 1 else "micro-batch")
    # Asked for a mode: that mode.
    _, _, mode = rank_profile(
        profile, workload.model, gradient_sync="window", per_rank_batch=batch, capacity_bytes=tight, **options
    )
    assert mode == "window"


def test_a_simulated_fsdp_plan_names_its_sync_mode() -> None:
    workload = load_workload("gpt-mini")
    plan = mb.plan(
        workload, batch=64, memory="2GiB", world_size=2, shard="fsdp", device="l4", policies=["none"]
    )
    assert plan.gradient_sync in ("window", "micro-batch")
    assert plan.to_dict()["gradient_sync"] == plan.gradient_sync
    assert f"gradient sync every {plan.gradient_sync}" in str(plan)


def test_a_real_fsdp_plan_needs_no_device_spec() -> None:
    workload = load_workload("gpt-mini")
    plan = mb.plan(
        workload, batch=8, memory="1GiB", world_size=2, shard="fsdp", max_profile_micro_batch_size=2
    )
    assert plan.shard == "fsdp" and plan.trials == 0
    assert any("interconnect not measured" in note for note in plan.notes)
    assert any("no trial in this one process" in note for note in plan.notes)


def test_the_optimizer_steps_on_the_local_shards(simulated: tuple[mb.Workload, mb.Profile]) -> None:
    # FSDP2's optimizer steps on each rank's DTensor shards: its temporaries (AdamW's foreach
    # copies of all of the rank's exp_avg_sq) are the shard's, a W-th of the whole model's.
    workload, profile = simulated
    assert profile.step_peak_bytes > 0
    for mode in ("window", "micro-batch"):
        sharded, _ = shard_profile(
            profile, workload.model, shard="fsdp", world_size=W, spec=devices()["l4"], gradient_sync=mode
        )
        assert sharded.step_peak_bytes == math.ceil(profile.step_peak_bytes / W)
        assert sharded.step_peak_name == SHARDED_STEP
    ddp, _ = shard_profile(profile, workload.model, shard="ddp", world_size=W, spec=devices()["l4"])
    assert ddp.step_peak_bytes == profile.step_peak_bytes  # every DDP rank steps on everything
