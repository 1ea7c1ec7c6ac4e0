"""The planner measures one rank's model alone: no "not wrapped in DDP" warning, no collective."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import microbatch as mb
from microbatch import distributed


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process group of 2 ranks as the library sees it, without starting one.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 0)


def _accumulator() -> mb.Accumulator:
    model = nn.Linear(3, 1)
    return mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)


def test_an_unwrapped_model_across_ranks_is_warned_about(
    two_ranks: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        _accumulator()
    assert any("neither DistributedDataParallel" in r.getMessage() for r in caplog.records)


def test_inside_single_process_the_rank_is_alone(two_ranks: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="microbatch"), distributed.single_process():
        assert distributed.world_size() == 1
        _accumulator()
    assert not [r for r in caplog.records if "DistributedDataParallel" in r.getMessage()]
    assert distributed.world_size() == 2  # restored on exit


def test_planning_on_rank_zero_warns_nothing_about_ddp(
    two_ranks: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Before single_process, every profiling run and trial window built an Accumulator on the
    # unwrapped model and warned (50 times for a 2-rank `torchrun ... microbatch train`).
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        planned = mb.plan("seed-linear", batch=8, memory="64MiB")
    assert planned.batch_size == 8
    assert not [r for r in caplog.records if "DistributedDataParallel" in r.getMessage()]
