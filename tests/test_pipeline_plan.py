"""The pipeline planner without processes: stage arithmetic, the per-stage solver, the plan's fields,
its refusals, and the simulated DP x PP x FSDP plan (planner/pipeline/stage_cost.py, pipeline_search.py,
pipeline_plan.py). The trials on real ranks: tests/distributed/test_pipeline_planned*.py."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch

import microbatch as mb
from microbatch.cli import main
from microbatch.distributed.stage_grads import used_parameter_names
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPT, GPTConfig, token_loss
from microbatch.planner import PlanOptions
from microbatch.planner.pipeline.layouts import micro_batch_counts
from microbatch.planner.pipeline.stage_cost import (
    in_flight,
    least_stage,
    solve_stage,
    stage_parameters,
    stage_segments,
)
from microbatch.planner.search.sizes import MAX_TIE_FRACTION, MIN_TIE_FRACTION, tie_fraction
from microbatch.profile import profile_workload
from microbatch.profile.costs import Fit, PolicyCost, SegmentProfile

CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8)


def gpt_workload() -> mb.Workload:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)

    def make_batch(rows: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, 256, (rows, CONFIG.block_size), generator=generator)
        return {"input_ids": tokens, "labels": tokens}

    return mb.Workload(
        model=GPT(CONFIG),
        make_batch=make_batch,
        loss=lambda model, batch: token_loss(model(batch["input_ids"]), batch["labels"]),
        name="gpt-tiny",
        pipeline_inputs=lambda batch: (batch["input_ids"], batch["labels"]),
        pipeline_loss=token_loss,
    )


def test_frozen_weights_are_charged_as_weights_only() -> None:
    # The Pipeline gives frozen parameters no gradient and no optimizer state (tests/distributed/
    # test_pipeline_window.py), so a stage's gradients and state are priced on its trainable bytes.
    model = GPT(CONFIG)
    names = [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    unfrozen = stage_parameters(model, names, [2])
    frozen_bytes = [0, 0]
    for stage, prefix in ((0, "blocks.0."), (1, "ln_f.")):
        for name, parameter in model.named_parameters():
            if name.startswith(prefix):
                parameter.requires_grad_(False)
                frozen_bytes[stage] += parameter.numel() * parameter.element_size()
    frozen = stage_parameters(model, names, [2])
    for stage in (0, 1):
        assert frozen_bytes[stage] > 0
        assert frozen[stage].parameter_bytes == unfrozen[stage].parameter_bytes  # weights still held
        assert unfrozen[stage].trainable_bytes == unfrozen[stage].parameter_bytes
        assert frozen[stage].trainable_bytes == unfrozen[stage].parameter_bytes - frozen_bytes[stage]


def test_in_flight_per_schedule() -> None:
    assert in_flight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert in_flight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight("1f1b", 4, 2) == (2, 2, 2, 1)
    assert micro_batch_counts(12) == [12, 6, 3, 1]
    with pytest.raises(ConfigError, match="gpipe or 1f1b"):
        in_flight("zigzag", 2, 2)


def test_stages_take_the_segments_and_the_parameters_torchs_tracer_gives_them() -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    workload = gpt_workload()
    profile = profile_workload(workload, micro_batch_sizes=[1, 2], policies=["none"], repeats=1)
    names = [[profile.segments[i].name for i in stage] for stage in stage_segments(profile, [2])]
    assert names[0][0] == "(before blocks)" and names[0][1:] == [
        "blocks.0",
        names[0][2],
        "blocks.1",
        names[0][4],
    ]
    assert names[1][0] == "blocks.2" and names[1][-1] == "(after blocks)"
    ours = stage_parameters(workload.model, [s.name for s in profile.blocks], [2])
    example = workload.make_batch(2)["input_ids"]
    traced = pipeline(GPT(CONFIG), mb_args=(example,), split_spec={"blocks.2": SplitPoint.BEGINNING})
    for stage, cost in enumerate(ours):
        module = traced.get_stage_module(stage)
        used = used_parameter_names(module)
        held = {id(p): p for n, p in module.named_parameters(remove_duplicate=False) if n in used}
        assert cost.parameter_bytes == sum(p.numel() * p.element_size() for p in held.values())
    # The tied token embedding / output head is held by both ends.
    assert ours[0].parameter_bytes + ours[1].parameter_bytes > sum(
        p.numel() * 4 for p in workload.model.parameters()
    )


def _segment(name: str, options: dict[str, tuple[int, int, float]], gradient_bytes: int) -> SegmentProfile:
    costs = {
        policy: PolicyCost(
            Fit.constant(kept), Fit.constant(peak), Fit.constant(seconds / 2), Fit.constant(seconds / 2)
        )
        for policy, (kept, peak, seconds) in options.items()
    }
    return SegmentProfile(name=name, is_block=True, costs=costs, gradient_bytes=gradient_bytes)


def test_the_stage_solver_is_the_brute_force_optimum() -> None:
    # (kept, peak, seconds) per policy; later blocks keep more, checkpointing keeps the boundary only.
    segments = [
        _segment(
            f"b{k}",
            {"none": (100 + 10 * k, 150, 1.0), "full": (10, 160 + 5 * k, 2.0), "selective": (50, 150, 1.3)},
            7,
        )
        for k in range(4)
    ]
    gradients, held = 28, (2, 1)

    def brute(choice: tuple[str, ...]) -> tuple[int, float]:
        kept = first = steady = 0
        later = sum(s.gradient_bytes for s in segments)
        seconds = 0.0
        for segment, policy in zip(segments, choice, strict=True):
            later -= segment.gradient_bytes
            cost = segment.costs[policy]
            first = max(first, kept + int(cost.peak(1)) + later)
            steady = max(steady, kept + int(cost.peak(1)) + gradients)
            kept += int(cost.kept(1))
            seconds += cost.seconds(1)  # each recompute's measured extra is above its floor here
        return max(held[0] * kept + first, held[1] * kept + steady), seconds

    every = {choice: brute(choice) for choice in itertools.product(("none", "full", "selective"), repeat=4)}
    for capacity in (400, 600, 800, 1200):
        found = solve_stage(
            segments, size=1, gradient_bytes=gradients, held_first=2, held_steady=1, capacity_bytes=capacity
        )
        fitting = [seconds for peak, seconds in every.values() if peak <= capacity]
        if not fitting:
            assert found is None
            continue
        assert found is not None and found.seconds == pytest.approx(min(fitting))
        assert found.activation_peak(2, 1) <= capacity
    least = least_stage(segments, size=1, gradient_bytes=gradients, held_first=2, held_steady=1)
    assert least.activation_peak(2, 1) == min(peak for peak, _ in every.values())


@pytest.fixture(scope="module")
def one_process_plan() -> mb.Plan:
    return mb.plan(gpt_workload(), batch=12, memory="64MiB", pipeline=2, max_grad_norm=1.0)


def test_a_pipeline_plan_in_one_process_is_predicted_and_says_so(one_process_plan: mb.Plan) -> None:
    plan = one_process_plan
    assert plan.pipeline_stages == 2 and plan.world_size == 1 and plan.trials == 0
    assert plan.pipeline_schedule in ("1f1b", "gpipe") and len(plan.stage_starts) == 1
    assert len(plan.stage_peak_bytes) == 2 and plan.predicted_peak_bytes == max(plan.stage_peak_bytes)
    assert 1 <= plan.pipeline_micro_batches <= plan.steps and sum(plan.micro_batch_sizes) == 12
    assert plan.bubble_fraction == pytest.approx(1 / (plan.pipeline_micro_batches + 1))
    assert any("no trial" in note for note in plan.notes)
    assert any("without a pipeline" in note for note in plan.notes)
    assert plan.max_grad_norm == 1.0  # Pipeline.backward clips; the plan says so
    assert mb.Plan.from_dict(json.loads(plan.to_json())) == plan
    text = str(plan)
    assert "pipeline: 2 stages" in text and "stage 1 from" in text
    with pytest.raises(ConfigError, match=r"plan\.pipeline"):
        plan.apply(torch.nn.Linear(1, 1), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))


def test_a_saved_pipeline_plan_that_contradicts_itself_is_refused(one_process_plan: mb.Plan) -> None:
    data = one_process_plan.to_dict()
    for field, value, words in (
        ("stage_starts", ["blocks.1", "blocks.2"], "stage_starts"),
        ("pipeline_micro_batches", data["steps"] + 1, "pipeline_micro_batches"),
        ("stage_peak_bytes", [1, 2, 3], "stage_peak_bytes"),
        ("pipeline_schedule", "zigzag", "pipeline_schedule"),
    ):
        with pytest.raises(ConfigError, match=words):
            mb.Plan.from_dict({**data, field: value})


def test_pipeline_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="pipeline_schedule"):
        PlanOptions(pipeline=2, pipeline_schedule="zigzag")
    with pytest.raises(ConfigError, match="not a multiple of pipeline=2"):
        PlanOptions(pipeline=2, world_size=3)
    with pytest.raises(ConfigError, match="simulated only"):
        mb.plan(gpt_workload(), batch=8, memory="64MiB", pipeline=2, world_size=4, shard="fsdp")
    for option in ({"accumulate_dtype": torch.float32}, {"scaler": True}):
        with pytest.raises(ConfigError, match=f"{next(iter(option))} with pipeline=2"):
            mb.plan(gpt_workload(), batch=8, memory="64MiB", pipeline=2, trial=False, **option)


def test_a_pipeline_plan_with_a_scaler_or_wide_sums_is_refused_by_name(one_process_plan: mb.Plan) -> None:
    # A hand-edited plan may carry options the Pipeline cannot honour: refused by name, never ignored.
    example = torch.zeros(one_process_plan.micro_batch_size, CONFIG.block_size, dtype=torch.long)
    for field, value in (("scaler", True), ("accumulate_dtype", "float32")):
        edited = replace(one_process_plan, **{field: value})
        with pytest.raises(ConfigError, match=f"a pipeline plan does not honour {field}="):
            edited.pipeline(GPT(CONFIG), example=example, loss_fn=token_loss)


def test_simulated_dp_by_pp_by_fsdp_plan_has_stage_peaks_and_the_comparison(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "llama-3.2-1b", "--device", "h100-80gb", "--world-size", "16", "--pipeline", "4"]
    argv += [
        "--shard",
        "fsdp",
        "--batch",
        "64",
        "--seq-len",
        "1024",
        "--memory",
        "20GiB",
        "--no-progress",
        "--json",
    ]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["simulated"] and plan["pipeline_stages"] == 4 and plan["world_size"] == 4
    assert len(plan["stage_peak_bytes"]) == 4 and max(plan["stage_peak_bytes"]) <= plan["budget_bytes"]
    assert "FSDP2 stage parameters, unsharded through the pipeline step" in plan["rank_parts"]
    comparison = [
        note for note in plan["notes"] if note.startswith("without a pipeline (16 ranks, shard fsdp)")
    ]
    assert len(comparison) == 1 and "bubble" in comparison[0]


def test_a_noisy_profile_never_calls_a_much_slower_plan_a_tie() -> None:
    # A profile timed on a loaded machine once spread 18.3x between rounds (time_noise 18.3): with
    # ties at 2 x noise every fitting plan was a tie, and on 2 ranks the tie rule chose a plan with no
    # checkpointing through 13 slow GPipe steps at a budget meant to make it checkpoint. Ties stop at
    # 8 % (search.MAX_TIE_FRACTION) whatever the noise, in the flat and the pipeline search; a
    # noiseless profile's ties are the floor, the spread between profiles (search.MIN_TIE_FRACTION).
    profile = profile_workload(gpt_workload())
    noisy = replace(profile, time_noise=18.3)
    assert tie_fraction(noisy) == MAX_TIE_FRACTION
    assert tie_fraction(replace(profile, time_noise=0.0)) == MIN_TIE_FRACTION
    quiet_plan, noisy_plan = (
        mb.plan(gpt_workload(), batch=12, memory="64MiB", pipeline=2, profile=p) for p in (profile, noisy)
    )
    limit = quiet_plan.predicted_seconds_per_step * (1 + MAX_TIE_FRACTION)
    assert noisy_plan.predicted_seconds_per_step <= limit * (1 + 1e-9)
