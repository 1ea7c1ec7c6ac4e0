"""distributed.decided_on_rank_zero on two gloo ranks: rank 0 decides alone and every rank gets its
result; an error on rank 0 reaches the other rank as a ConfigError instead of a hang."""

from __future__ import annotations

import decision_workers as w
import pytest

from microbatch import distributed
from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed]


def test_rank_zero_decides_for_every_rank() -> None:
    runs = launch(w.decisions, world_size=2, timeout_s=120.0)
    assert [run["value"] for run in runs] == [{"chosen_by": 0}, {"chosen_by": 0}]
    assert [run["ran"] for run in runs] == [[0], []]  # rank 1 never decided
    assert runs[0]["error"] == "ValueError: no plan fits"
    assert runs[1]["error"] == "ConfigError: rank 0 stopped planning for the test: ValueError: no plan fits"


def test_one_process_decides_itself() -> None:
    assert distributed.decided_on_rank_zero(lambda: 7, what="anything") == 7
