"""Plans at the run's edges (issue 35): a save cut short keeps the old plan; apply checks the model."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from microbatch.errors import ConfigError
from microbatch.planner import Plan
from microbatch.planner.result import plan_file


class Blocks(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def plan_for(model: nn.Module, *, batch: int = 8) -> Plan:
    count = sum(parameter.numel() for parameter in model.parameters())
    return Plan.manual(batch_size=batch, micro_batch_size=2, parameters=count)


def test_a_save_cut_short_leaves_the_old_plan_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    old = plan_for(Blocks(4, 2), batch=8)
    old.save(path)
    before = path.read_bytes()

    def full_disk(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plan_file.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        plan_for(Blocks(4, 2), batch=16).save(path)
    assert path.read_bytes() == before and Plan.load(path).batch_size == 8
    assert [entry.name for entry in tmp_path.iterdir()] == ["plan.json"]  # no temporary left
    monkeypatch.undo()
    plan_for(Blocks(4, 2), batch=16).save(path)
    assert json.loads(path.read_text())["batch_size"] == 16


def test_apply_refuses_a_plan_made_for_another_model() -> None:
    small, large = Blocks(4, 2), Blocks(32, 2)  # 64x the parameters' weights
    optimizer = torch.optim.SGD(large.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"another model.*parameters"):
        plan_for(small).apply(large, optimizer)
    accumulator = plan_for(large).apply(large, optimizer)  # its own plan applies
    accumulator.close()


def test_a_workload_factory_that_needs_arguments_is_the_users_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from microbatch.errors import WorkloadError
    from microbatch.workload import load_workload

    (tmp_path / "needs_arg_workload.py").write_text("def make(size):\n    raise AssertionError('called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadError, match=r"make\(\) is called with no arguments.*'size'.*defaults"):
        load_workload("needs_arg_workload:make")
