"""FSDP2 (fully_shard) + accumulation on two gloo processes against the single-process full batch.

Gradients are sharded DTensors; each rank gathers the full gradient (full_tensor) when the optimizer
steps. Tolerance: float64, rtol 1e-9 / atol 1e-12 (summation order and one normalising multiply).
"""

from __future__ import annotations

import dist_workers as w
import pytest

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-9, "atol": 1e-12}
STEPS = 3
SIZES = [[3, 1, 4, 2, 5], [2, 4, 1, 3, 2]]
UNEVEN = [[3, 1, 4, 2, 5, 1, 2], [2, 4, 1, 3]]
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.fsdp_all, SIZES, STEPS, UNEVEN, world_size=2, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("mode", ["skip", "every"])
def test_gradient_equals_global_full_batch(runs: list[dict], mode: str) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run[mode]["grads"], SIZES, STEPS, **TOL)


def test_clipping_with_dtensor_gradients_uses_the_global_norm(runs: list[dict]) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run["clip"]["grads"], SIZES, STEPS, max_grad_norm=0.05, **TOL)
        assert all(s["grad_norm"] > 0.05 for s in rank_run["clip"]["stats"])


def test_sync_flag_off_for_all_but_the_last_backward_and_true_after(runs: list[dict]) -> None:
    for rank_run in runs:
        # Windows of 3 then 2 micro-batches: the flag each backward saw.
        assert rank_run["skip"]["flags_in_backward"] == [False, False, True, False, True]
        assert rank_run["every"]["flags_in_backward"] == [True] * 5
        assert all(rank_run["skip"]["flags_after"]) and len(rank_run["skip"]["flags_after"]) == 2


def test_sync_flag_true_after_an_exception_inside_a_window(runs: list[dict]) -> None:
    for rank_run in runs:
        assert all(rank_run["flags_after_body_error"])  # raised in the loop body, generator still alive
        assert rank_run["backward_error"] == "backward failed on purpose"
        assert all(rank_run["flags_after_backward_error"])  # raised inside a non-last backward


def test_uneven_data_exact(runs: list[dict]) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run["uneven"]["grads"], UNEVEN, STEPS, **TOL)
    assert runs[1]["uneven"]["padding"] == [False] * 4 + [True] * 3
