"""Property-style: window sizes that m does and does not divide (1 to 3 pipeline steps), both loss
forms users write (masked mean, cross_entropy with ignore_index), with and without frozen layers, the
tied embedding / head on both ends; every window's stage gradients against the float64 full batch.

Tolerance: float64, rtol 1e-9 / atol 1e-15 (as test_pipeline.py). 2 gloo processes, 2 stages.
"""

from __future__ import annotations

import math

import pytest
import torch
import window_workers as ww

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-9, "atol": 1e-15}
M = 2


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch(ww.property_runs, M, world_size=2, timeout_s=400.0)


@pytest.mark.parametrize("loss", list(ww.LOSSES))
@pytest.mark.parametrize("frozen", [False, True])
def test_every_window_is_the_full_batch(runs: list[dict], loss: str, frozen: bool) -> None:
    key = f"{loss}-{'frozen' if frozen else 'all'}"
    sizes = ww.PROPERTY_SIZES
    assert {math.ceil(s / M) for s in sizes} == {1, 2, 3} and any(s % M for s in sizes)
    seen: dict[str, int] = {}
    for rank_run in runs:
        run = rank_run[key]
        data = ww.pw.micro_batches(7, run["rows"])
        start = 0
        for index, size in enumerate(sizes):
            window = data[start : start + size]
            start += size
            expected, expected_loss = ww.reference(window, loss, frozen=frozen)
            stats = run["stats"][index]
            assert stats["pipeline_steps"] == math.ceil(size / M)
            assert stats["loss"] == pytest.approx(expected_loss, rel=1e-12)
            for name, grad in run["grads"][index].items():
                seen[name] = seen.get(name, 0) + 1
                if expected[name] is None:
                    assert grad is None, f"{key}: frozen {name} got a gradient"
                    continue
                where = f"{key} window {index} ({size} micro-batches), {name}"
                torch.testing.assert_close(grad, expected[name], msg=lambda m, x=where: f"{x}: {m}", **TOL)
    # Every parameter of the model was checked on some rank (the tied weight on both ends).
    names = {n for n, _ in ww.make_model(frozen).named_parameters(remove_duplicate=False)}
    assert set(seen) == names
    assert "token_embedding.weight" in seen and "lm_head.weight" in seen
