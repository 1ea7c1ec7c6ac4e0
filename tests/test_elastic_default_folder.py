"""torchrun restarts a run started without --out: the restarted ranks find the runs/MODEL-DATE-TIME
folder this launch made (its marker holds TORCHELASTIC_RUN_ID) and resume it (issue 35).

One process stands in for torchrun's ranks: the environment torchrun gives a restarted rank
(TORCHELASTIC_RUN_ID the same, TORCHELASTIC_RESTART_COUNT one higher) is set by the test; the
launches under torchrun itself are tests/distributed/test_elastic_restart.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from microbatch.cli import main

TRAIN = ["train", "--model", "gpt-nano", "--batch", "8", "--micro-batch", "4", "--no-progress"]


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _launch(monkeypatch: pytest.MonkeyPatch, launch: str, restart: int, *args: str) -> int:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", launch)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    return main([*TRAIN, *args])


def test_a_restart_without_out_resumes_the_folder_its_launch_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # The launch's first attempt: 2 steps checkpointed, then (in real life) a rank dies.
    assert _launch(monkeypatch, "launch-a", 0, "--steps", "2", "--checkpoint-interval", "1") == 0
    (made,) = list((tmp_path / "runs").iterdir())
    # Another launch's folder, with a checkpoint too, made later: never taken for this launch's.
    assert _launch(monkeypatch, "launch-b", 0, "--steps", "1", "--checkpoint-interval", "1") == 0
    # torchrun restarts launch-a's ranks with the same command: they resume its folder.
    assert _launch(monkeypatch, "launch-a", 1, "--steps", "4", "--checkpoint-interval", "1") == 0
    assert len(list((tmp_path / "runs").iterdir())) == 2  # no third folder
    records = [json.loads(line) for line in (made / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Bitwise the losses of one uninterrupted run.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert main([*TRAIN, "--steps", "4", "--out", str(tmp_path / "whole")]) == 0
    assert _losses(made) == _losses(tmp_path / "whole")


def test_a_restart_before_any_checkpoint_starts_a_new_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _launch(monkeypatch, "launch-c", 1, "--steps", "1") == 0  # nothing of launch-c saved yet
    assert len(list((tmp_path / "runs").iterdir())) == 1
