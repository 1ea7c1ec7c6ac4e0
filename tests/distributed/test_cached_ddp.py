"""Gradient caching under DDP on two gloo processes against the single-process full batch.

The representations of both ranks are all-gathered for the loss, so each rank's InfoNCE sees the
global batch's negatives. Tolerance: float64, rtol 1e-10 / atol 1e-13 (summation order only).
"""

from __future__ import annotations

import cached_workers as w
import pytest
import torch

from dual_encoder import grads, make_batch, make_models
from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-10, "atol": 1e-13}
LOCAL = [12, 9]  # uneven rows per rank, as many micro-batches of 4 (3 each)
WINDOW = [[8, 8], [6, 7]]  # a window of two global batches: 16 and 13 samples
SEEDS = [21, 22]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(w.run_all, LOCAL, WINDOW, SEEDS, world_size=2, timeout_s=240.0)


def test_gradient_equals_single_process_full_batch(runs: list[dict]) -> None:
    encoder, loss_fn = make_models()
    batch = make_batch(sum(LOCAL), seed=SEEDS[0])
    loss = loss_fn(encoder.encode(batch))
    loss.backward()
    expected = grads(encoder, loss_fn)
    for run in runs:
        actual = run["one_batch"]["grads"]
        assert actual.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], **TOL)
        assert run["one_batch"]["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
        assert run["one_batch"]["allreduce_calls"] == 1  # one bucket, synchronised once


def test_accumulator_window_equals_single_process_step(runs: list[dict]) -> None:
    encoder, loss_fn = make_models()
    params = [*encoder.parameters(), *loss_fn.parameters()]
    batches = [make_batch(sum(sizes), seed=seed) for sizes, seed in zip(WINDOW, SEEDS, strict=True)]
    # The window's loss: the sample-weighted mean of its batches' (coupled) losses.
    total = sum(sum(sizes) for sizes in WINDOW)
    loss = sum(loss_fn(encoder.encode(b)) * b["image"].shape[0] for b in batches) / total
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
    with torch.no_grad():
        for p in params:
            p -= 0.5 * p.grad
    expected = {f"0.{n}": p.detach() for n, p in encoder.named_parameters()}
    expected.update({f"1.{n}": p.detach() for n, p in loss_fn.named_parameters()})
    for run in runs:
        window = run["window"]
        assert window["grad_norm"] == pytest.approx(float(norm), rel=1e-10)
        assert window["grad_norm"] > 0.05  # clipping was active
        assert window["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
        for name in expected:
            torch.testing.assert_close(window["params"][name], expected[name], **TOL)
        assert window["allreduce_calls"] == 1  # once per window, not per batch or micro-batch
