"""DDP + accumulation on two gloo processes against the single-process full batch.

Tolerance: float64, rtol 1e-9 / atol 1e-12. The only differences from the reference are the
summation order (per micro-batch, per rank, then DDP's all-reduce) and the one normalising multiply
in step(); they cost a few ulps.
"""

from __future__ import annotations

import dist_workers as w
import pytest
import torch

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-9, "atol": 1e-12}
STEPS = 3
# Sequences per micro-batch on each rank; token counts vary per sequence as well.
SIZES = [[3, 1, 4, 2, 5], [2, 4, 1, 3, 2]]  # 5 micro-batches each: windows of 3, then a partial 2
UNEVEN = [[3, 1, 4, 2, 5, 1, 2], [2, 4, 1, 3]]  # rank 1 runs out in window 1; window 2 is rank 0's
TIMEOUT_S = 240.0  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.ddp_all, SIZES, STEPS, UNEVEN, world_size=2, timeout_s=TIMEOUT_S)


def test_gradient_equals_global_full_batch_with_sync_skipped(runs: list[dict]) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run["skip"]["grads"], SIZES, STEPS, **TOL)


def test_data_makes_the_global_count_matter() -> None:
    # Averaging each rank's own full-batch gradient (local token counts, DDP's plain mean) is
    # visibly wrong on this data, so the test above would catch a per-rank normalisation.
    data = [w.micro_batches(r, sizes[:STEPS]) for r, sizes in enumerate(SIZES)]
    per_rank = [w.reference_grads((torch.cat([b[0] for b in d]), torch.cat([b[1] for b in d]))) for d in data]
    token_counts = [[int((b[1] != -100).sum()) for b in d] for d in data]
    assert sum(token_counts[0]) != sum(token_counts[1])
    expected = w.reference_grads(w.window_batches(SIZES, STEPS)[0])
    gap = max(float(((per_rank[0][n] + per_rank[1][n]) / 2 - expected[n]).abs().max()) for n in expected)
    scale = max(float(expected[n].abs().max()) for n in expected)
    assert gap / scale > 1e-3


def test_window_stats_are_global(runs: list[dict]) -> None:
    for index, batch in enumerate(w.window_batches(SIZES, STEPS)):
        model = w.make_model()
        loss, items = w.token_mean(model, batch)
        for rank_run in runs:
            stats = rank_run["skip"]["stats"][index]
            assert stats["items"] == int(items)
            assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
    assert runs[0]["world_size_from_env"] == 2


def test_one_gradient_allreduce_round_per_window(runs: list[dict]) -> None:
    # The tiny model fits one DDP bucket: one hook call per all-reduce round, on the last micro-batch.
    for rank_run in runs:
        assert rank_run["skip"]["hook_calls"] == [(0, 2), (1, 1)]


def test_every_micro_batch_sync_when_asked_and_still_exact(runs: list[dict]) -> None:
    for rank_run in runs:
        assert rank_run["every"]["hook_calls"] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        w.assert_windows_match(rank_run["every"]["grads"], SIZES, STEPS, **TOL)


def test_clipping_uses_the_global_norm(runs: list[dict]) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run["clip"]["grads"], SIZES, STEPS, max_grad_norm=0.05, **TOL)
        for index, batch in enumerate(w.window_batches(SIZES, STEPS)):
            expected = w.reference_grads(batch)
            norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected.values()])))
            assert norm > 0.05  # clipping is active
            assert rank_run["clip"]["stats"][index]["grad_norm"] == pytest.approx(norm, rel=1e-9)


def test_uneven_data_no_hang_and_exact(runs: list[dict]) -> None:
    # Reaching here means both ranks finished within TIMEOUT_S.
    for rank_run in runs:
        w.assert_windows_match(rank_run["uneven"]["grads"], UNEVEN, STEPS, **TOL)
        assert rank_run["uneven"]["hook_calls"] == [(0, 2), (1, 2), (2, 0)]
        assert [s["micro_batches"] for s in rank_run["uneven"]["stats"]] == [3, 3, 1]
    # Rank 1 has 4 micro-batches: it repeats its last one (weight 0) for the rest of the run.
    assert runs[0]["uneven"]["padding"] == [False] * 7
    assert runs[1]["uneven"]["padding"] == [False] * 4 + [True] * 3


def test_uneven_data_without_accumulation_exact(runs: list[dict]) -> None:
    for rank_run in runs:
        w.assert_windows_match(rank_run["uneven_steps_1"]["grads"], UNEVEN, 1, **TOL)
        assert rank_run["uneven_steps_1"]["hook_calls"] == [(window, 0) for window in range(7)]
    assert runs[1]["uneven_steps_1"]["padding"] == [False] * 4 + [True] * 3


def test_empty_loader_on_one_rank_is_a_clear_error_on_every_rank(runs: list[dict]) -> None:
    for rank_run in runs:
        assert "empty on 1 of 2 rank(s)" in rank_run["empty_error"]


def test_inner_module_instead_of_ddp_warns_on_rank_zero(runs: list[dict]) -> None:
    assert any("DistributedDataParallel" in message for message in runs[0]["inner_module_warnings"])
    assert runs[1]["inner_module_warnings"] == []
    for rank_run in runs:
        assert rank_run["inner_module_windows"] == [2, 1]
