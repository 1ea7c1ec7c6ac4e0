"""Where a pipeline cuts the model and the option errors: no processes needed."""

from __future__ import annotations

import pytest
import torch

from microbatch.distributed.pipeline import Pipeline
from microbatch.distributed.stages import balanced_cuts, find_block_names, stage_starts
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPT, GPTConfig, token_loss


def tiny_gpt(layers: int = 4) -> GPT:
    return GPT(GPTConfig(n_layer=layers, n_head=2, n_embd=8, block_size=6))


def test_balanced_cuts_minimise_the_largest_stage() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1]  # 5 | 5
    assert balanced_cuts([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # 6 | 9 | 6: the largest stage is 9
    # Brute force over every 3-stage cut of a small list agrees on the optimum's value.
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    best = min(
        max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
        for i in range(1, len(costs))
        for j in range(i + 1, len(costs))
    )
    i, j = balanced_cuts(costs, 3)
    assert max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:])) == best


def test_tied_cuts_give_the_extra_layer_to_a_late_stage_whatever_the_last_bits() -> None:
    """80 equal layers and a heavier head in 8 stages: some stage must take 11 layers. Among the tied
    partitions the later stages are the longest (1F1B holds S - s micro-batches on stage s), and
    costs that differ in their last bits, as sums of measured times do, do not move that."""
    costs = [0.041, *[0.0373] * 78, 0.082]
    noisy = [cost * (1 + (-1) ** index * 1e-13 * index) for index, cost in enumerate(costs)]
    assert balanced_cuts(costs, 8) == balanced_cuts(noisy, 8) == [10, 20, 30, 40, 50, 60, 71]


def test_fewer_blocks_than_stages_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"2 block\(s\), fewer than the 3 pipeline stages"):
        stage_starts(tiny_gpt(2), 3)


def test_auto_blocks_are_the_transformer_blocks_and_costs_move_the_cut() -> None:
    model = tiny_gpt()
    assert find_block_names(model) == [f"blocks.{i}" for i in range(4)]
    assert stage_starts(model, 2) == ["blocks.2"]
    seconds = {"blocks.0": 3.0, "blocks.1": 1.0, "blocks.2": 1.0, "blocks.3": 1.0}
    assert stage_starts(model, 2, block_costs=seconds) == ["blocks.1"]


def test_named_cuts_are_checked() -> None:
    model = tiny_gpt()
    assert stage_starts(model, 3, ["blocks.1", "blocks.3"]) == ["blocks.1", "blocks.3"]
    with pytest.raises(ConfigError, match=r"2 name\(s\) for 3 stages"):
        stage_starts(model, 3, ["blocks.1"])
    with pytest.raises(ConfigError, match=r"no module named 'blocks\.9'"):
        stage_starts(model, 2, ["blocks.9"])
    with pytest.raises(ConfigError, match="model order"):
        stage_starts(model, 3, ["blocks.3", "blocks.1"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_stages": 1}, "num_stages must be an integer >= 2"),
        ({"num_stages": 2, "schedule": "zigzag"}, "schedule must be one of"),
        ({"num_stages": 2, "micro_batches": 0}, "micro_batches"),
        ({"num_stages": 2}, "needs 2 processes; launch with `torchrun"),
    ],
)
def test_option_errors(options: dict, message: str) -> None:
    arguments = {"micro_batches": 2, "example": torch.zeros(2, 6, dtype=torch.long), "loss_fn": token_loss}
    with pytest.raises(ConfigError, match=message):
        Pipeline(tiny_gpt(), **{**arguments, **options})


def test_batchnorm_and_wrapped_models_are_refused() -> None:
    arguments = {"num_stages": 2, "micro_batches": 2, "example": torch.zeros(2, 4), "loss_fn": token_loss}
    with_bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"BatchNorm \(1\).*convert_batchnorm_to_groupnorm"):
        Pipeline(with_bn, **arguments)
