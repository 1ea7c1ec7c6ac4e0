"""ExactAccumulation under Lightning's DDP on two gloo ranks whose token counts differ.

Each rank runs Trainer(strategy="ddp", devices=2, accelerator="cpu", accumulate_grad_batches=3) on its
own 14 variable-length sequences (rank 0 long, rank 1 short; micro-batch 4): a window of 12 per rank and
the epoch's short last window of 2 per rank. The gradient each optimizer step sees, on both ranks, must be
the full-batch gradient of the token-mean loss over both ranks' sequences of that window, computed here
in one float64 batch from the same initial model (lr 0, so every window starts there). Tolerance rtol
1e-10 / atol 1e-12: float64, only the summation order differs. Without the callback the same run is off
by tens of percent (checked too, so the comparison can fail).
"""

from __future__ import annotations

import lightning_workers as w
import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("lightning")

from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = {"rtol": 1e-10, "atol": 1e-12}
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return launch(w.both, world_size=2, timeout_s=TIMEOUT_S)


def _references() -> list[dict[str, torch.Tensor]]:
    ex = w.example()
    result = []
    for rows in zip(w.windows(0), w.windows(1), strict=True):
        torch.manual_seed(0)
        module = ex.NextToken().double()
        batch = ex.collate(rows[0] + rows[1])
        logits = module.net(batch["input_ids"])
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        result.append({n: p.grad.detach().clone() for n, p in module.named_parameters()})
    return result


def _tokens(rows: list[torch.Tensor]) -> int:
    return sum(len(row) - 1 for row in rows)


def test_every_step_on_every_rank_is_the_full_batch_gradient(runs: list[list[dict]]) -> None:
    assert _tokens(w.windows(0)[0]) > 3 * _tokens(w.windows(1)[0])  # the ranks' items do differ
    references = _references()
    for rank_runs in runs:
        exact = rank_runs[0]
        assert exact["world_size"] == 2
        assert exact["steps"] == len(references) == 2  # a full window and the short last one
        for got, want in zip(exact["grads"], references, strict=True):
            assert set(got) == set(want)
            for key in want:
                torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_without_the_callback_ddp_accumulation_is_off(runs: list[list[dict]]) -> None:
    want = _references()[0]
    got = runs[0][1]["grads"][0]
    difference = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
    assert difference / sum(float(v.norm() ** 2) for v in want.values()) ** 0.5 > 0.05
