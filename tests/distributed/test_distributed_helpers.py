"""microbatch.distributed's helpers in one process (no process group): environment, logging, sync."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from microbatch import distributed
from microbatch.errors import ConfigError


def test_world_size_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.world_size_from_env() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed.world_size_from_env() == 4
    for bad in ["two", "0", "-1"]:
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match="WORLD_SIZE"):
            distributed.world_size_from_env()


def test_launched_by_torchrun_and_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"]:
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched_by_torchrun()
    assert distributed.local_rank() == 0
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert not distributed.launched_by_torchrun()  # MASTER_PORT missing
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.launched_by_torchrun()
    assert distributed.local_rank() == 1


def test_single_process_defaults() -> None:
    assert not distributed.is_initialized()
    assert (distributed.world_size(), distributed.rank(), distributed.is_rank_zero()) == (1, 0, True)
    assert distributed.all_reduce_values([2.0, 3.5]) == [2.0, 3.5]
    assert distributed.init_from_env(backend="gloo") == torch.device("cpu")  # not under torchrun: no-op
    assert not distributed.is_initialized()
    model = nn.Linear(2, 2)
    assert distributed.data_parallel_kind(model) is None
    assert distributed.wrap_data_parallel(model, torch.device("cpu")) is model


def test_rank_zero_logging(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("microbatch.test")
    with caplog.at_level(logging.INFO, logger="microbatch"):
        distributed.log_rank_zero(log, logging.INFO, "hello %d", 7)
    assert [r.getMessage() for r in caplog.records] == ["hello 7"]
    record = logging.LogRecord("microbatch", logging.INFO, __file__, 1, "x", None, None)
    assert distributed.RankZeroFilter().filter(record)


def test_other_ranks_stay_quiet(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(distributed.process, "rank", lambda: 1)
    with caplog.at_level(logging.INFO, logger="microbatch"):
        distributed.log_rank_zero(logging.getLogger("microbatch.test"), logging.WARNING, "not on rank 1")
    assert caplog.records == []
    record = logging.LogRecord("microbatch", logging.INFO, __file__, 1, "x", None, None)
    assert not distributed.RankZeroFilter().filter(record)
