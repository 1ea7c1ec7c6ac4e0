"""fit_trainer's loss weighting across two gloo DDP ranks whose items differ.

Each rank trains one optimizer step of a tiny float64 model through the transformers Trainer (micro 4 x
2 accumulation steps x 2 ranks = 16 samples, or the plan fit_trainer makes for 16); the ranks' halves
hold very different numbers of items (long sequences on one, short on the other). The gradient the
optimizer sees on each rank must be the full-batch gradient of the mean over all 16 samples' items
(tokens for the causal LM, samples whose label is not -100 for the classifier), computed here in one
float64 batch from the same initial model. Weighting each rank equally, as DDP's averaging does by
itself, is off by tens of percent (checked too).

Tolerance: the classifier rtol 1e-9 / atol 1e-12 (float64, summation order); the causal LM rtol 1e-6 /
atol 1e-8, because transformers' ForCausalLMLoss casts the logits to float32 (tests/test_hf_exact.py).
"""

from __future__ import annotations

import hf_exact_workers as w
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import test_hf_exact as exact
from microbatch.distributed.launch import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 300.0  # a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    return launch(w.all_cases, world_size=2, timeout_s=TIMEOUT_S)


def _reference(name: str) -> dict[str, torch.Tensor]:
    return exact.full_batch_gradient(exact._model(name), exact.collate(w.examples(name)))


@pytest.mark.parametrize("case", range(len(w.CASES)))
def test_each_rank_steps_with_the_full_batch_gradient(runs: list[list[dict]], case: int) -> None:
    name, _ = w.CASES[case]
    want = _reference(name)
    tolerance = exact.FLOAT32_LOSS_TOL if name.endswith("causal-lm") else exact.TOL
    ranks = [rank_runs[case] for rank_runs in runs]
    assert [run["world_size"] for run in ranks] == [2, 2]
    assert ranks[0]["plan"] == ranks[1]["plan"]  # both ranks run the same plan
    micro, steps = ranks[0]["plan"]
    assert micro * steps * 2 == w.SAMPLES
    assert sum(ranks[0]["items"]) != sum(ranks[1]["items"])  # the ranks' items do differ
    for run in ranks:
        assert set(run["grads"]) == set(want)
        for key in want:
            torch.testing.assert_close(
                run["grads"][key], want[key], **tolerance, msg=lambda m, key=key: f"{name} {key}: {m}"
            )


def test_fit_trainer_applies_rank_zeros_plan_on_every_rank(runs: list[list[dict]]) -> None:
    # Planned on each rank from its own timings, two ranks could choose two plans and deadlock DDP;
    # rank 0's plan (its planning time too, which no second planning would repeat) is on both.
    fitted = [rank_runs[2] for rank_runs in runs]
    assert fitted[0]["planning_seconds"] is not None
    assert fitted[0]["planning_seconds"] == fitted[1]["planning_seconds"]


def test_equal_rank_weights_would_be_off(runs: list[list[dict]]) -> None:
    # What the test guards against: each rank's own full-batch mean, averaged by DDP with weight 1/2.
    name = w.CASES[0][0]
    rows = w.examples(name)
    halves = [[rows[i] for i in range(w.SAMPLES) if (i // w.MICRO) % 2 == rank] for rank in range(2)]
    per_rank = [exact.full_batch_gradient(exact._model(name), exact.collate(half)) for half in halves]
    averaged = {key: (per_rank[0][key] + per_rank[1][key]) / 2 for key in per_rank[0]}
    assert exact._relative_error(averaged, _reference(name)) > 0.05
    assert exact._relative_error(runs[0][0]["grads"], _reference(name)) < 1e-6
