"""Whole-run memory evidence of ``microbatch train`` (issue 33): each window's peak, the worst against
the plan's budget in summary.json, and the windows measured chosen so that none worse is missed.

Measured by the CPU MemoryTracker (memory/window_peaks.py). One planned run (about 20 s of profiling on
gpt-nano); the other runs reuse its plan.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from microbatch import cli
from microbatch.memory.window_peaks import PeakMemory, covered, worst_window

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NANO = ("--model", "gpt-nano", "--batch", "8", "--no-progress", "--seed", "3")
BUDGET = 2 * 2**20


def _train(out: Path, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    assert cli.main(["train", *NANO, "--out", str(out), *extra]) == 0
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("peaks") / "planned"
    # Module scope runs outside conftest's per-test logger restore: cli.main configures the package
    # logger (no propagation), so put it back here or later modules' caplog sees nothing.
    package_logger = logging.getLogger("microbatch")
    handlers, level, propagate = list(package_logger.handlers), package_logger.level, package_logger.propagate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary, metrics = _train(out, "--memory", str(BUDGET), "--steps", "12")
    finally:
        torch.set_num_threads(threads)
        package_logger.handlers[:] = handlers
        package_logger.setLevel(level)
        package_logger.propagate = propagate
    return out, summary, metrics


def test_summary_states_the_worst_window_within_the_budget(
    planned: tuple[Path, dict[str, Any], list[dict[str, Any]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, summary, metrics = planned
    assert summary["budget_bytes"] == BUDGET
    assert summary["worst_window_peak_bytes"] <= BUDGET and summary["windows_over_budget"] == 0
    measured = [r for r in metrics if r["peak_measured"]]
    assert 2 <= summary["windows_measured"] == len(measured) < len(metrics)  # not every window: cheap
    worst = max(metrics, key=lambda r: r["peak_bytes"])
    assert (summary["worst_window_step"], summary["worst_window_peak_bytes"]) == (
        worst["step"],
        worst["peak_bytes"],
    )
    # The same run with every window measured (--checkpoint-interval 1; same seed, same plan, same
    # sequences): each window's bound holds, and the run's worst is within the inputs' slack of it.
    every, all_metrics = _train(
        tmp_path / "every", "--plan", str(out / "plan.json"), "--steps", "12", "--checkpoint-interval", "1"
    )
    capsys.readouterr()
    assert [r["loss"] for r in all_metrics] == [r["loss"] for r in metrics]
    assert every["windows_measured"] == 12 and every["worst_window_measured"] is True
    for record in all_metrics:
        selective = next(r for r in metrics if r["step"] == record["step"])
        assert selective["peak_bytes"] >= record["peak_bytes"], (selective, record)
    # a window's inputs: at most 8 rows x 32 positions of int64 ids and labels
    slack_bytes = summary["worst_window_peak_bytes"] - every["worst_window_peak_bytes"]
    assert 0 <= slack_bytes <= 8 * 32 * 8 * 2


def test_nothing_grows_after_the_first_window(
    planned: tuple[Path, dict[str, Any], list[dict[str, Any]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Fixed rows: every window has one shape. AdamW creates its state at the first step, so the first
    window runs without it and the second peaks higher (measured: 1.24 vs 1.52 MB); the planner's trial
    creates the state before it measures, so it prices the second window. From then on nothing grows
    (the metrics history, the gradient-norm buffers): every later window peaks as the second did."""
    out, _, _ = planned
    summary, metrics = _train(
        tmp_path / "rows", "--plan", str(out / "plan.json"), "--steps", "6", "--max-tokens", "off",
        "--checkpoint-interval", "1",
    )  # fmt: skip
    capsys.readouterr()
    peaks = [r["peak_bytes"] for r in metrics]
    assert all(r["peak_measured"] for r in metrics)
    assert peaks[0] < peaks[1]  # the lazily created optimizer state
    assert peaks[2:] == [peaks[1]] * 4, peaks
    plan = json.loads((out / "plan.json").read_text())
    assert max(peaks) <= summary["budget_bytes"] == BUDGET
    # The trial (one micro-batch's inputs, the state created first) against the run's second window
    # (the whole window's inputs drawn at once: 8 rows x 33 int64 ids and labels, set aside by the plan).
    window_inputs_bytes = 8 * 32 * 8 * 2
    assert peaks[1] <= plan["measured_peak_bytes"] + window_inputs_bytes


def test_windows_measured_are_those_that_could_be_the_worst() -> None:
    peak = PeakMemory(torch.device("cpu"), model=None, optimizer=None, every=50)

    def window(*shapes: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": torch.zeros(rows, length, dtype=torch.long)} for rows, length in shapes]

    for step, batches in enumerate([window((2, 30), (2, 20)), window((2, 10))], start=1):
        with peak.measure(step, batches):  # the tracker sees the inputs only: 800 and 160 bytes
            pass
    assert (peak.highest_bytes, peak.highest_step) == (800, 1)
    assert peak.windows_measured == 2 and peak.shapes == [(2, 30)]
    assert peak.fewest_inputs_bytes == 2 * 10 * 8
    assert covered((1, 30), peak.shapes) and covered((2, 5), peak.shapes)
    assert not covered((3, 10), peak.shapes) and not covered((1, 31), peak.shapes)
    assert not peak.should_measure(3, window((2, 12), (1, 30)))  # covered
    assert peak.should_measure(3, window((1, 31)))  # longer rows
    assert peak.should_measure(3, window((3, 8)))  # more rows
    assert peak.should_measure(50, window((1, 1)))  # the spot check
    assert peak.should_measure(3, None) is False
    with peak.measure(3, window((2, 30), (2, 30))):  # covered, 2 x 2 x 30 int64 more than the fewest
        pass
    assert peak.record() == {"peak_bytes": 800 + 8 * (120 - 20), "peak_measured": False, "peak_step": 1}
    metrics = [
        {"step": 1, "peak_bytes": 10, "peak_measured": True},
        {"step": 2, "peak_bytes": 30, "peak_measured": True},
        {"step": 3, "peak_bytes": 30, "peak_measured": False},
        {"step": 4, "peak_bytes": 25, "peak_measured": False},
    ]
    assert worst_window(metrics, 20) == {
        "budget_bytes": 20, "worst_window_peak_bytes": 30, "worst_window_step": 2,
        "worst_window_measured": True, "windows_measured": 2, "windows_over_budget": 3,
    }  # fmt: skip
    assert worst_window(metrics, 0)["windows_over_budget"] is None  # a manual plan: no budget


def test_on_cuda_every_window_reads_the_allocators_reserved_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path without a GPU: every window measured, its peak statistics reset at its start and
    max_memory_reserved read at its end (the test_gpu case below runs it on a device)."""
    calls: list[str] = []
    reserved = iter([700, 900, 800])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))
    monkeypatch.setattr(
        torch.cuda, "max_memory_reserved", lambda device: calls.append("read") or next(reserved)
    )
    peak = PeakMemory(torch.device("cuda", 0), model=None, optimizer=None, every=50)
    batches = [{"input_ids": torch.zeros(2, 4, dtype=torch.long)}]
    records = []
    for step in (1, 2, 3):
        with peak.measure(step, batches):
            calls.append("window")
        records.append({"step": step, **peak.record()})
    assert calls == ["reset", "window", "read"] * 3 and peak.source == "cuda-reserved"
    assert [r["peak_bytes"] for r in records] == [700, 900, 800] and all(r["peak_measured"] for r in records)
    assert worst_window(records, 850)["windows_over_budget"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_states_its_worst_reserved_window_within_the_budget(tmp_path: Path) -> None:
    summary, metrics = _train(tmp_path / "cuda", "--device", "cuda", "--memory", "256MiB", "--steps", "6")
    assert summary["peak_bytes_source"] == "cuda-reserved" and summary["windows_measured"] == 6
    assert all(r["peak_measured"] for r in metrics)
    assert summary["worst_window_peak_bytes"] <= summary["budget_bytes"] == 256 * 2**20
