"""The pipeline predictor's schedule arithmetic (planner/pipeline.py), without processes."""

from __future__ import annotations

import pytest
import torch

from microbatch.errors import ConfigError
from microbatch.models.gpt import GPT, GPTConfig, token_loss
from microbatch.planner.pipeline import StageCost, in_flight, predict_pipeline, profile_stages


def test_in_flight_per_schedule() -> None:
    assert in_flight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert in_flight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight("1f1b", 4, 2) == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match="gpipe or 1f1b"):
        in_flight("zigzag", 2, 2)


def test_prediction_formula() -> None:
    cost = StageCost(
        one_bytes=1000, kept_bytes=100, start_bytes=300, forward_bytes=150, parameter_bytes=200,
        input_bytes=10, output_bytes=20, result_bytes=0, seconds=0.5,
    )  # fmt: skip
    gpipe = predict_pipeline([cost, cost], micro_batches=4, schedule="gpipe")
    # 1000 + 3 x 100 held + 3 x (10 + 20) further receive buffers; the forward moment (300 + 200 +
    # 300 + 150 = 950) is lower.
    assert gpipe.peak_bytes == (1390, 1390)
    assert gpipe.seconds_per_step == pytest.approx(5 * 0.5)  # (m + S - 1) x slowest
    assert gpipe.bubble_fraction == pytest.approx(1 / 5)
    one = predict_pipeline(
        [cost, cost], micro_batches=4, schedule="1f1b", optimizer_state_per_parameter_byte=2
    )
    assert one.peak_bytes == (1000 + 100 + 90 + 400, 1000 + 90 + 400)


def test_profile_stages_measures_each_stage() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8))
    tokens = torch.randint(0, 256, (2, 8))
    costs = profile_stages(model, num_stages=2, example=tokens, labels=tokens, loss_fn=token_loss, rounds=1)
    assert len(costs) == 2
    activation = 2 * 8 * 16 * 4  # one (rows, time, width) float32 tensor
    assert costs[0].input_bytes == 0 and costs[1].input_bytes == activation  # tokens are not received
    assert costs[0].output_bytes == activation and costs[1].output_bytes == 0
    for cost in costs:
        assert cost.one_bytes > cost.kept_bytes > activation
        assert cost.seconds > 0


def test_choose_pipeline_fits_the_budget_and_refuses_below_the_least() -> None:
    from microbatch.errors import InfeasibleBudgetError
    from microbatch.planner.pipeline import choose_pipeline

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8))

    def make_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (rows, 8))
        return tokens, tokens

    options = {"num_stages": 2, "rows": 8, "make_batch": make_batch, "loss_fn": token_loss}
    roomy = choose_pipeline(model, budget_bytes=1 << 40, **options)
    assert len(roomy.considered) == 2 * 4  # sizes 1, 2, 4, 8 under two schedules
    least = min(worst for _, _, worst, _ in roomy.considered)
    tight = choose_pipeline(model, budget_bytes=least, **options)
    assert max(tight.prediction.peak_bytes) == least
    assert tight.micro_batches * tight.micro_batch_size >= 8
    with pytest.raises(InfeasibleBudgetError, match="least predicted stage peak"):
        choose_pipeline(model, budget_bytes=least - 1, **options)
