"""benchmarks/planner_real.py's cell order, micro-batch floor and window sizes (no model is trained)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

import pytest
from torch import nn

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def planner_real(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("planner_real")


@pytest.mark.parametrize("floor", [1, 2, 3])
def test_window_sizes_respect_the_floor(planner_real: ModuleType, floor: int) -> None:
    for batch in (7, 32):
        for size in range(floor, batch + 1):
            sizes = list(planner_real.window_sizes(batch, size, floor))
            assert sum(sizes) == batch, (batch, size, sizes)
            assert min(sizes) >= floor, (batch, size, sizes)
            assert batch % floor or max(sizes) <= size, (batch, size, sizes)


def test_window_sizes_keep_the_plain_split_when_it_fits(planner_real: ModuleType) -> None:
    assert list(planner_real.window_sizes(32, 6, 2)) == [6, 6, 6, 6, 6, 2]
    assert list(planner_real.window_sizes(32, 31, 2)) == [16, 16]  # 31 + 1 shared evenly


def test_min_micro_batch_is_two_with_batchnorm(planner_real: ModuleType) -> None:
    def work(model: nn.Module) -> object:
        return argparse.Namespace(model=model)

    assert planner_real.min_micro_batch(work(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))) == 2
    assert planner_real.min_micro_batch(work(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))) == 1


def test_cells_run_in_the_given_order(planner_real: ModuleType) -> None:
    order = "swin_t:tight,resnet50:tight,swin_t:loose"
    args = argparse.Namespace(cells=order, budgets="tight,mid,loose", models="")
    assert planner_real.cells(args) == [("swin_t", "tight"), ("resnet50", "tight"), ("swin_t", "loose")]
    assert args.models == "swin_t,resnet50"
    every = argparse.Namespace(cells=None, budgets="tight,loose", models="a,b")
    assert planner_real.cells(every) == [("a", "tight"), ("a", "loose"), ("b", "tight"), ("b", "loose")]


@pytest.mark.parametrize("bad", ["resnet50", "resnet50:huge", "resnet50:tight:mid"])
def test_cells_name_the_format_on_a_bad_pair(planner_real: ModuleType, bad: str) -> None:
    args = argparse.Namespace(cells=bad, budgets="tight,mid,loose", models="")
    with pytest.raises(SystemExit, match="model:budget"):
        planner_real.cells(args)


def test_unknown_model_names_the_choices(planner_real: ModuleType) -> None:
    with pytest.raises(SystemExit, match="resnet50"):
        planner_real.workload("no-such-model", 32)


def test_vision_model_without_torchvision_names_the_venv(planner_real: ModuleType) -> None:
    vision_real = importlib.import_module("vision_real")
    if vision_real.torchvision is not None:
        pytest.skip("torchvision is installed here")
    with pytest.raises(SystemExit, match="venv"):
        planner_real.workload("resnet50", 32)


def test_misses_name_the_planners_numbers_only_for_missed_cells(planner_real: ModuleType) -> None:
    def entry(ratio: float, peak: int) -> dict[str, object]:
        return {
            "budget_bytes": 100,
            "plan_peak_bytes": peak,
            "ratio": ratio,
            "best_hand": "every block full at 6",
            "profile_predicted_seconds": {"plan": 2.5, "every block full": 2.0},
            "plan_predicted_seconds": 2.25,
            "plan_predicted_peak_bytes": 99,
            "plan_trial_peak_bytes": 98,
        }

    report = {"cells": {"a tight": entry(1.10, 90), "b tight": entry(1.0, 101), "c tight": entry(1.02, 100)}}
    lines = "\n".join(planner_real.misses(report))
    assert "a tight (behind the best hand)" in lines and "b tight (over budget)" in lines
    assert "c tight" not in lines
    assert "2.250 s for its plan" in lines and "2.000 s for every block full" in lines
    assert planner_real.misses({"cells": {"c tight": entry(1.02, 100)}}) == []
