"""2 replicas x 2 stages on 4 gloo processes: a shape error on one replica only (a collator that pads
each batch to its longest row) raises a clear error on every rank, before any collective of the
window, instead of leaving the other replica waiting in the cross-replica all-reduce; the next window
then runs on every rank."""

from __future__ import annotations

import pytest
import window_workers as ww

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(ww.shape_error_on_one_replica, 2, world_size=4, timeout_s=300.0)


def test_a_shape_error_on_one_replica_raises_on_every_rank(runs: list[dict]) -> None:
    assert [r["replica"] for r in runs] == [0, 0, 1, 1]
    for rank_run in runs:
        error = rank_run["error"]
        assert error is not None and "stopped on every rank" in error
        assert "on rank 2 (and 1 other rank(s))" in error and "micro-batch 1" in error


def test_the_next_window_runs_on_every_rank(runs: list[dict]) -> None:
    items = sum(int((b[1] != -100).sum()) for r in (0, 1) for b in ww.pw.micro_batches(10 + r, [3, 2, 1]))
    assert {r["stats"]["items"] for r in runs} == {items}
