"""A user's own error while mb.plan runs their code keeps its type and says where planning was
(issue 35, item 10): PEP 678 notes, not a replacement."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import microbatch as mb
from microbatch.cli import main
from microbatch.errors import planning_notes
from microbatch.profile import profile_workload
from microbatch.workload import Workload, seed_linear


class UnsortedLabelsError(ValueError):
    """The user's own error type: their handlers catch it by name."""


def _failing(*, at_size: int | None, in_backward: bool = False, workload: Workload | None = None) -> Workload:
    workload = workload or seed_linear()
    inner = workload.loss

    def refuse(grad: torch.Tensor) -> torch.Tensor:
        raise UnsortedLabelsError("the labels' gradient is not allowed")

    def loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        if at_size in (None, len(batch[0])) and not in_backward:
            raise UnsortedLabelsError("labels must be sorted")
        value, items = inner(model, batch)
        if len(batch[0]) == at_size:
            value.register_hook(refuse)
        return value, items

    workload.loss = loss
    return workload


def test_an_error_in_the_loss_while_profiling_keeps_its_type_and_names_the_size() -> None:
    with pytest.raises(UnsortedLabelsError, match="labels must be sorted") as caught:
        mb.plan(_failing(at_size=4), batch=8, memory="64MiB")
    (note,) = planning_notes(caught.value)
    assert "loss(model, batch) (the forward)" in note and "micro-batch of 4 samples" in note
    assert "seed-linear" in note and "profiled" in note
    frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert frames[-1] == "loss"  # the user's own frame is where it points, as before


def test_an_error_in_the_backward_is_said_to_come_from_the_backward() -> None:
    with pytest.raises(UnsortedLabelsError) as caught:
        mb.plan(_failing(at_size=4, in_backward=True), batch=8, memory="64MiB")
    (note,) = planning_notes(caught.value)
    assert "the backward of loss(model, batch)" in note and "micro-batch of 4 samples" in note


def test_an_error_in_the_trial_window_names_the_plan_tried() -> None:
    good = seed_linear()
    profile = profile_workload(good, micro_batch_sizes=(1, 2, 4))
    bad = _failing(at_size=None, workload=good)  # the profile was measured: only the trial calls it now
    with pytest.raises(UnsortedLabelsError) as caught:
        mb.plan(bad, batch=8, memory="64MiB", profile=profile)
    (note,) = planning_notes(caught.value)
    assert "tried micro-batch" in note and "window" in note


def test_the_command_line_shows_the_note_in_its_one_line(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "failing_loss.py").write_text(
        "import tests.test_user_errors_noted as t\ndef workload():\n    return t._failing(at_size=4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["plan", "failing_loss:workload", "--batch", "8", "--memory", "64MiB", "--no-progress"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "UnsortedLabelsError: labels must be sorted" in line
    assert "micro-batch of 4 samples" in line and "This is a bug" not in line
