"""2 data-parallel replicas x 2 pipeline stages on 4 gloo processes, against the single-process
full batch of both replicas' micro-batches. Tolerance as in test_pipeline.py (float64, rtol 1e-9).

The replicas hold different numbers of micro-batches (7 and 4): with 3 pipeline steps per window,
replica 1 has nothing in the last window and adds nothing while replica 0 finishes it.
"""

from __future__ import annotations

import pipeline_workers as w
import pytest
from test_pipeline import ROWS, M, assert_exact

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROWS_PER_REPLICA = [ROWS, [2, 3, 1, 2]]
TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.dp_by_pp, ROWS_PER_REPLICA, M, world_size=4, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("key", ["gpipe-1", "gpipe-3", "1f1b-1", "1f1b-3"])
def test_every_rank_gradient_equals_the_global_full_batch_gradient(runs: list[dict], key: str) -> None:
    for rank_run in runs:
        assert_exact(rank_run[key], ROWS_PER_REPLICA, 3 if key.endswith("-3") else 1)


def test_layout_is_replica_major(runs: list[dict]) -> None:
    assert [r["1f1b-1"]["stages"] for r in runs] == [[0], [1], [0], [1]]


def test_items_are_summed_over_replicas(runs: list[dict]) -> None:
    for index, window in enumerate(w.windows_of(ROWS_PER_REPLICA, M * 3)):
        items = sum(int((b[1] != -100).sum()) for replica in window for b in replica)
        assert {r["1f1b-3"]["stats"][index]["items"] for r in runs} == {items}
    # Window 1: replica 1 has run out (no micro-batch) and still took part.
    assert [r["1f1b-3"]["stats"][1]["micro_batches"] for r in runs] == [1, 1, 0, 0]


def test_clipping_on_the_global_norm_with_replicas(runs: list[dict]) -> None:
    for rank_run in runs:
        assert_exact(rank_run["clip"], ROWS_PER_REPLICA, 3, max_grad_norm=0.05)
    norms = {round(r["clip"]["stats"][0]["grad_norm"], 12) for r in runs}
    assert len(norms) == 1


def test_data_makes_the_replica_weighting_matter() -> None:
    # Averaging the replicas' own full-batch gradients (DDP's mean) is visibly wrong on this data.
    window = w.windows_of(ROWS_PER_REPLICA, M)[0]
    per_replica = [w.reference_grads(replica) for replica in window]
    expected = w.reference_grads([b for replica in window for b in replica])
    name = "blocks.0.mlp.fc.weight"
    gap = (per_replica[0][name] + per_replica[1][name]) / 2 - expected[name]
    assert float(gap.abs().max() / expected[name].abs().max()) > 1e-3
