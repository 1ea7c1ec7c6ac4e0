"""The progress line and the plan line say what their numbers are (issue 25, point 2)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from microbatch import cli
from microbatch.commands.train import ProgressLine
from microbatch.training import StepReport


def report(step: int, *, val: float | None = None, peak_step: int | None = None) -> StepReport:
    return StepReport(
        step=step, total_steps=200, loss=2.5, lr=3e-3, tokens_per_second=15000.0, peak_bytes=70 * 2**20,
        eta_seconds=29.0, val_loss=val, peak_step=peak_step, peak_what="micro-batches of <= 8192 tokens",
    )  # fmt: skip


def test_a_validation_loss_from_an_earlier_step_is_marked_with_its_step() -> None:
    progress = ProgressLine(io.StringIO())
    assert "| val" not in progress.format(report(20, peak_step=20))
    fresh = progress.format(report(40, val=3.142, peak_step=40))
    assert "| val 3.142 |" in fresh  # computed on this step: no mark
    stale = progress.format(report(60, peak_step=50))
    assert "| val 3.142 (step 40) |" in stale
    assert "peak 70.00 MiB (step 50, micro-batches of <= 8192 tokens)" in stale
    assert "peak 70.00 MiB (micro-batches of <= 8192 tokens)" in fresh


def test_train_prints_which_peak_is_which(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "gpt-nano", "--batch", "8", "--memory", "3MiB", "--steps", "4"]
    code = cli.main([*argv, "--eval-interval", "2", "--out", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = {line.split()[1]: line for line in captured.err.splitlines() if line.startswith("step ")}
    assert "| val " not in lines["1/4"]
    assert "| val " in lines["2/4"] and "(step 2) |" not in lines["2/4"]
    assert "(step 2) |" in lines["3/4"]  # step 2's validation loss, marked as such
    assert "micro-batches of <= " in lines["3/4"] and " tokens)" in lines["3/4"]  # --max-tokens auto
    plan_line = next(line for line in captured.out.splitlines() if line.startswith("plan: "))
    assert "in the trial (micro-batches of 8 rows)" in plan_line  # rows as make_batch builds them
