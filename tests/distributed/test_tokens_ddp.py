"""Token-budget windows on two gloo DDP ranks that need different micro-batch counts.

Tolerance: float64, rtol 1e-10 / atol 1e-13 against the single-process full batch of both ranks'
windows together; only the summation order differs (micro-batches, ranks, DDP's all-reduce).
"""

from __future__ import annotations

import pytest
import token_workers as w
import torch

from equivalence import assert_grads_close, full_batch_grads
from microbatch.distributed.launch import launch
from microbatch.models.workloads import gpt_loss

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-10, "atol": 1e-13}
WINDOWS = 2
TIMEOUT_S = 240.0  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.tokens_all, WINDOWS, world_size=2, timeout_s=TIMEOUT_S)


def test_ranks_need_different_counts_and_run_the_largest(runs: list[dict]) -> None:
    fewest = [run["fewest"] for run in runs]
    assert all(a > b for a, b in zip(fewest[0], fewest[1], strict=True))  # the data does differ
    for run in runs:
        assert run["steps"] == [n for n in fewest[0] for _ in range(n)]
        assert max(run["padded_tokens"]) <= w.MAX_TOKENS


def test_window_gradient_equals_the_single_process_full_batch(runs: list[dict]) -> None:
    model = w.make_model()
    windows = [w.rank_windows(rank, WINDOWS) for rank in range(2)]
    for index in range(WINDOWS):
        expected, _ = full_batch_grads(model, gpt_loss, w.pad(windows[0][index] + windows[1][index]))
        for run in runs:
            assert_grads_close(run["grads"][index], expected, **TOL)
    assert runs[0]["grads"][0].keys() == {n for n, _ in model.named_parameters()}
    assert not torch.equal(
        runs[0]["grads"][0]["token_embedding.weight"], runs[0]["grads"][1]["token_embedding.weight"]
    )


def test_uneven_window_counts_fail_on_every_rank_without_a_hang(runs: list[dict]) -> None:
    for run in runs:
        assert run["uneven_error"] is not None and "same number of windows" in run["uneven_error"]
