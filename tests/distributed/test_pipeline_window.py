"""One pipeline window keeps the Accumulator's rules, on 2 gloo processes (2 stages).

The losses users write (a masked mean, ``F.cross_entropy(..., ignore_index=-100)``) are 0/0 on a
micro-batch without items; the pipeline's own filler micro-batches (a window that m does not divide)
must add an exact zero without calling them. Frozen parameters get no gradient, are not reduced,
are not handed to the optimizer and do not move under AdamW's weight decay.

Tolerance: float64, rtol 1e-9 / atol 1e-15 against the single-process full batch (as test_pipeline.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import window_workers as ww

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-9, "atol": 1e-15}
M = 2  # micro-batches per pipeline step; windows of 3 and 5 micro-batches: m does not divide them
SIZES = [3, 5]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(ww.one_window, M, world_size=2, timeout_s=400.0)


def windows(rows: list[int], seed: int = 0) -> list[list[ww.Batch]]:
    data = ww.pw.micro_batches(seed, rows)
    out, start = [], 0
    for size in SIZES:
        out.append(data[start : start + size])
        start += size
    return out


@pytest.mark.parametrize("loss", list(ww.LOSSES))
def test_a_window_m_does_not_divide_is_exact_and_finite(runs: list[dict], loss: str) -> None:
    for rank_run in runs:
        run = rank_run[loss]
        for index, window in enumerate(windows(run["rows"])):
            expected, expected_loss = ww.reference(window, loss, frozen=True)
            stats = run["stats"][index]
            assert stats["pipeline_steps"] == math.ceil(SIZES[index] / M)
            assert math.isfinite(stats["grad_norm"]) and math.isfinite(stats["loss"])
            assert stats["loss"] == pytest.approx(expected_loss, rel=1e-12)
            for name, grad in run["grads"][index].items():
                if expected[name] is None:
                    assert grad is None, f"frozen {name} got a gradient"
                    continue
                where = f"{loss} window {index}, {name}"
                torch.testing.assert_close(grad, expected[name], msg=lambda m, x=where: f"{x}: {m}", **TOL)


def test_frozen_parameters_are_not_trained(runs: list[dict]) -> None:
    trained = set()
    for rank_run in runs:
        names = rank_run["masked_mean"]["trained"]
        assert not [n for n in names if n.startswith(ww.FROZEN)]
        trained |= set(names)
    model = ww.make_model(frozen=True)
    assert trained == {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def test_frozen_parameters_do_not_move_under_weight_decay(runs: list[dict]) -> None:
    for rank_run in runs:
        moved = rank_run["weight_decay"]["moved"]
        frozen = {n: v for n, v in moved.items() if n.startswith(ww.FROZEN)}
        trained = {n: v for n, v in moved.items() if not n.startswith(ww.FROZEN)}
        assert frozen and all(v == 0.0 for v in frozen.values()), frozen
        assert trained and all(v > 0.0 for v in trained.values())
