"""The planner's progress drawn as a bar with what runs and an estimate, for plan and train
(issue 25, point 3)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.commands.progress import PlanningBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_what_runs_the_time_spent_and_the_estimate() -> None:
    times = iter([0.0, 10.0, 20.0, 40.0, 41.0])
    stream = Terminal()
    bar = PlanningBar(stream, now=lambda: next(times))
    bar("policy none, micro-batch 1", 0, 4)
    bar("policy full, micro-batch 8", 1, 4)  # 10 s per run so far, 3 runs left
    assert stream.getvalue().endswith(
        "planning [#####...............] 1/4 policy full, micro-batch 8 | 0:10, ETA 0:30"
    )
    bar("policy full, micro-batch 16", 2, 4)
    bar("done", 4, 4)
    text = stream.getvalue()
    assert text.endswith("\n") and text.rstrip().endswith(
        "4/4 done | 0:40"
    )  # a finished phase keeps its line
    bar("trial 1: micro-batch 16 x 4 with none x4", 0, 1)  # a new phase, its own clock
    assert stream.getvalue().endswith("planning: trial 1: micro-batch 16 x 4 with none x4 | 0:00\n")


def test_in_a_log_the_bar_writes_quarters_only() -> None:
    stream = io.StringIO()
    bar = PlanningBar(stream, now=lambda: 0.0)
    for done in range(49):
        bar(f"run {done}", done, 48)
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["0/48", "12/48", "24/48", "36/48", "48/48"]


def test_train_and_plan_draw_the_planning_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "gpt-nano", "--batch", "8", "--memory", "3MiB", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "planning [" in err and " | " in err  # the profiling runs, with time spent
    assert "planning: trial 1: micro-batch" in err
    assert err.index("planning [") < err.index("step 1/1")
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert "planning [" not in capsys.readouterr().err
