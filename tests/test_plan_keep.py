"""Plans you can keep: one Plan type, save / load, checked against the model, used by ``train --plan``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import microbatch as mb
from microbatch import cli
from microbatch.errors import ConfigError
from microbatch.models.workloads import gpt_workload
from microbatch.planner import FrontierPoint
from microbatch.planner.result.text import SHOWN_FRONTIER_ROWS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def nano_plan() -> mb.Plan:
    torch.set_num_threads(1)
    return mb.plan(gpt_workload("gpt-nano"), batch=8, memory="3MiB", trial=False)


def test_save_load_round_trip_is_equal(nano_plan: mb.Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    nano_plan.save(path)
    loaded = mb.Plan.load(path)
    assert loaded == nano_plan
    assert mb.Plan.from_dict(json.loads(path.read_text())) == nano_plan
    manual = mb.Plan.manual(batch_size=10, micro_batch_size=4, policies={"blocks.0": "full"})
    manual.save(path)
    assert mb.Plan.load(path) == manual
    assert manual.micro_batch_sizes == (4, 4, 2)


def test_load_refuses_what_is_not_a_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        mb.Plan.load(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a microbatch plan"):
        mb.Plan.load(tmp_path / "list.json")
    (tmp_path / "partial.json").write_text('{"workload": "x", "batch_size": 8}')
    with pytest.raises(ConfigError, match="not a microbatch plan"):
        mb.Plan.load(tmp_path / "partial.json")


def test_a_plan_for_another_model_is_refused(nano_plan: mb.Plan) -> None:
    nano_plan.check_model(gpt_workload("gpt-nano").model, device="cpu")
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="made for another model") as raised:
        nano_plan.check_model(other, device="cpu")
    assert "no block(s) 'blocks.0'" in str(raised.value)
    assert "parameters" in str(raised.value)
    with pytest.raises(ConfigError, match="the device is meta, the plan was made for cpu"):
        nano_plan.check_model(gpt_workload("gpt-nano").model, device="meta")


def test_apply_can_be_undone_and_twice_is_an_error() -> None:
    workload = gpt_workload("gpt-nano")
    model = workload.model
    plan = mb.Plan.manual(batch_size=8, micro_batch_size=4, policies={"blocks.0": "full", "blocks.1": "none"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulator = plan.apply(model, optimizer)
    assert accumulator.steps_for(0) == 2
    assert "_microbatch_checkpoint_policy" in model.blocks[0].__dict__
    with pytest.raises(ConfigError, match=r"already has a plan applied; call plan.remove\(model\)"):
        plan.apply(model, optimizer)
    plan.remove(model)
    assert not any("_microbatch_checkpoint_policy" in m.__dict__ for m in model.modules())
    plan.apply(model, optimizer)  # applies again once removed
    plan.remove(model)


def test_print_shows_at_most_ten_frontier_rows(nano_plan: mb.Plan) -> None:
    # A frontier of 30 alternatives (micro-batch 1..30); the chosen one is micro-batch 8.
    points = tuple(
        FrontierPoint(
            micro_batch_size=size,
            steps=-(-8 // size),
            block_policies=nano_plan.block_policies if size == 8 else (),
            predicted_peak_bytes=1000 * size,
            seconds_per_step=1.0 / size,
        )
        for size in range(30, 0, -1)
    )
    plan = dataclasses.replace(nano_plan, frontier=points, micro_batch_size=8)
    text = str(plan)
    rows = text.split("Frontier")[1].splitlines()[2:]
    shown = [row for row in rows if row.strip() and not row.strip().startswith(("...", "note:"))]
    assert len(shown) == SHOWN_FRONTIER_ROWS
    assert sum(row.startswith("  *") for row in shown) == 1
    assert "30 frontier rows in all" in text
    assert len(plan.to_dict()["frontier"]) == 30


def test_plan_out_then_train_with_the_saved_plan(
    nano_plan: mb.Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    nano_plan.save(path)
    run_dir = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "--model",
            "gpt-nano",
            "--batch",
            "8",
            "--plan",
            str(path),
            "--steps",
            "1",
            "--no-progress",
            "--out",
            str(run_dir),
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    used = mb.Plan.load(run_dir / "plan.json")
    assert dataclasses.replace(used, measured_peak_bytes=None, cuda_max_allocated_bytes=None, trials=0) == (
        dataclasses.replace(nano_plan, trials=0)
    )
    assert used.measured_peak_bytes is not None  # proved by a trial window (no --no-trial)
    # The same file for a run with another batch: refused before anything is written.
    code = cli.main(
        ["train", "--model", "gpt-nano", "--batch", "16", "--plan", str(path), "--out", str(tmp_path / "b")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "is for batch 8" in err.strip().splitlines()[-1]
    assert not (tmp_path / "b").exists()


def test_train_refuses_a_plan_for_another_model(
    nano_plan: mb.Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    dataclasses.replace(nano_plan, parameters=123).save(path)
    code = cli.main(
        [
            "train",
            "--model",
            "gpt-nano",
            "--batch",
            "8",
            "--plan",
            str(path),
            "--no-trial",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "made for another model" in err.strip().splitlines()[-1]
    assert "Traceback" not in err


def test_microbatch_plan_out_writes_a_loadable_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    code = cli.main(
        ["plan", "seed-linear", "--batch", "4", "--memory", "1GiB", "--no-trial", "--out", str(path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"plan saved: {path}" in out
    loaded = mb.Plan.load(path)
    assert loaded.batch_size == 4 and loaded.parameters is not None and loaded.device == "cpu"


@pytest.mark.slow
def test_resume_with_less_memory_replans_for_the_same_batch(tmp_path: Path) -> None:
    from microbatch.training import TrainConfig, train

    base = TrainConfig(
        model="gpt-nano", batch=8, eval_interval=100, out=str(tmp_path / "r"), trial=False, max_tokens="off"
    )
    roomy = train(dataclasses.replace(base, steps=1, memory="1GiB"))
    assert roomy.plan["steps"] == 1
    tight = train(dataclasses.replace(base, steps=2, memory="950KiB", resume=True))
    assert tight.plan["steps"] > 1  # re-planned at the window boundary for the smaller budget
    assert tight.plan["batch_size"] == 8
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [m["micro_batches"] for m in lines] == [1, tight.plan["steps"]]
    assert mb.Plan.load(tmp_path / "r" / "plan.json").steps == tight.plan["steps"]


def test_planning_the_real_model_leaves_it_untouched(tmp_path: Path) -> None:
    # microbatch train plans the model it then trains (no copy): profiling and the trial restore
    # its weights, gradients, modes and random state exactly, so a planned run and a run of the
    # same plan loaded from a file (no planning at all) train bitwise alike, with dropout on.
    from microbatch.training import TrainConfig, train

    base = TrainConfig(model="gpt-nano", batch=8, steps=2, eval_interval=100, dropout=0.1)
    planned = train(dataclasses.replace(base, memory="3MiB", out=str(tmp_path / "planned")))
    loaded = train(
        dataclasses.replace(
            base, plan=str(tmp_path / "planned" / "plan.json"), trial=False, out=str(tmp_path / "loaded")
        )
    )
    assert (
        planned.plan["source"] == "planner"
        and loaded.plan["micro_batch_size"] == planned.plan["micro_batch_size"]
    )
    a = [json.loads(line) for line in (tmp_path / "planned" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "loaded" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]


def test_plan_out_to_an_unwritable_path_is_refused_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing-folder" / "plan.json"
    code = cli.main(["plan", "seed-linear", "--batch", "4", "--memory", "1GiB", "--out", str(target)])
    err = capsys.readouterr().err
    assert code == 2
    assert "--out" in err and "cannot write there" in err
    assert "planning:" not in err  # refused before any profiling
