"""How a batch may be split: min_micro_batch_size, even, prefer_large_micro_batches; BatchNorm notes."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from microbatch.cli import main
from microbatch.errors import ConfigError
from microbatch.models import vision
from microbatch.profile import profile_workload


def deeplab_workload() -> mb.Workload:
    """A small DeepLabV3-style segmenter: BatchNorm after global pooling (ASPP) fails at micro-batch 1."""
    torch.manual_seed(0)
    model = vision.DeepLabV3MobileNetV3(width=4, num_classes=3)
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, 3, 16, 16, generator=generator)
        return images, torch.randint(0, 3, (size, 16, 16), generator=generator)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        images, masks = batch
        return F.cross_entropy(module(images), masks), int(images.shape[0])

    return mb.Workload(model=model, make_batch=make_batch, loss=loss, name="deeplab-tiny")


def mlp_workload() -> mb.Workload:
    """Activations dominate (wide hidden layers), so the budget decides the micro-batch size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4096), nn.Tanh(), nn.Linear(4096, 1))
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return F.mse_loss(module(batch[0]), batch[1]), int(batch[0].shape[0])

    optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    return mb.Workload(model=model, make_batch=make_batch, loss=loss, optimizer=optimizer, name="mlp")


def test_batchnorm_failing_at_micro_batch_one_is_explained() -> None:
    with pytest.raises(ConfigError, match="BatchNorm") as raised:
        mb.plan(deeplab_workload(), batch=8, memory="1GiB", policies=["none"], trial=False)
    assert "min_micro_batch_size=2" in str(raised.value) and "--min-micro-batch 2" in str(raised.value)


def test_min_micro_batch_size_holds_for_profile_and_last_micro_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    workload = deeplab_workload()
    roomy = mb.plan(workload, batch=9, memory="1GiB", policies=["none"], min_micro_batch_size=2, trial=False)
    # A budget between the smallest plan and one micro-batch of 9 forces a split.
    budget = (roomy.minimum_bytes + roomy.predicted_peak_bytes) // 2
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        plan = mb.plan(
            workload,
            batch=9,
            memory=budget,
            policies=["none"],
            min_micro_batch_size=2,
            max_profile_micro_batch_size=4,
        )
    assert plan.steps > 1 and sum(plan.micro_batch_sizes) == 9
    assert min(plan.micro_batch_sizes) >= 2  # 9 = 4 + 4 + 1 is never chosen
    assert all(point.micro_batch_size >= 2 for point in plan.frontier)
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert any(
        "BatchNorm layer(s) train" in note and "prefer_large_micro_batches" in note for note in plan.notes
    )
    assert "micro-batches per step" not in caplog.text  # the trial's cut window does not warn
    accumulator = plan.apply(workload.model, torch.optim.SGD(workload.model.parameters(), lr=0.01))
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        for micro in accumulator.iterate(plan.split(workload.make_batch(9))):
            loss, items = workload.loss(workload.model, micro.batch)
            accumulator.backward(loss, items=items)
            if micro.is_last:
                accumulator.step()
    assert f"train with {plan.steps} micro-batches per step" in caplog.text


def test_even_splits_exactly_and_moves_a_prime_batch_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    workload = mlp_workload()
    profile = profile_workload(workload, micro_batch_sizes=(2, 8, 16), repeats=1)
    whole = mb.plan(workload, batch=16, memory="1GiB", profile=profile, trial=False)
    budget = whole.minimum_bytes + (whole.predicted_peak_bytes - whole.minimum_bytes) // 3  # about b = 6
    even = mb.plan(workload, batch=12, memory=budget, profile=profile, trial=False, even=True)
    assert even.micro_batch_size * even.steps == 12 and len(set(even.micro_batch_sizes)) == 1
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        moved = mb.plan(
            workload, batch=13, memory=budget, profile=profile, trial=False, even=True, min_micro_batch_size=2
        )
    assert moved.batch_size in (12, 14) and moved.micro_batch_size * moved.steps == moved.batch_size
    assert "changed from 13" in caplog.text and any("changed from 13" in note for note in moved.notes)


def test_prefer_large_picks_the_largest_micro_batch_that_fits() -> None:
    workload = mlp_workload()
    profile = profile_workload(workload, micro_batch_sizes=(1, 8, 16), repeats=1)
    whole = mb.plan(workload, batch=16, memory="1GiB", profile=profile, trial=False)
    budget = (whole.minimum_bytes + whole.predicted_peak_bytes) // 2
    fastest = mb.plan(workload, batch=16, memory=budget, profile=profile, trial=False)
    large = mb.plan(
        workload, batch=16, memory=budget, profile=profile, trial=False, prefer_large_micro_batches=True
    )
    # The frontier holds the points no other is both faster and smaller than; under timing noise the
    # chosen large point may be dominated and absent, so it is compared with every fitting point.
    fitting = [p.micro_batch_size for p in large.frontier if p.predicted_peak_bytes <= budget]
    assert large.predicted_peak_bytes <= budget
    assert large.micro_batch_size >= max(fitting, default=0)
    assert large.micro_batch_size >= fastest.micro_batch_size


def test_min_micro_batch_size_is_checked() -> None:
    with pytest.raises(ConfigError, match="min_micro_batch_size"):
        mb.plan(mlp_workload(), batch=4, memory="1GiB", min_micro_batch_size=8)
    with pytest.raises(ConfigError, match="min_micro_batch_size"):
        mb.plan(mlp_workload(), batch=4, memory="1GiB", min_micro_batch_size=0)


def test_command_line_min_micro_batch(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "test_split_rules:deeplab_workload",
        "--batch",
        "6",
        "--memory",
        "1GiB",
        "--policies",
        "none",
    ]
    assert main([*args, "--no-trial", "--json", "--min-micro-batch", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert min(data["micro_batch_sizes"]) >= 2
    assert main([*args, "--no-trial"]) == 2
    assert "--min-micro-batch 2" in capsys.readouterr().err
