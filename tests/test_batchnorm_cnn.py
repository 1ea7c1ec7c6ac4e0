"""The BatchNorm CNN on digit images: verify's BatchNorm diagnostic and the momentum correction.

BatchNorm normalises each micro-batch with its own statistics, so accumulation cannot match the
full batch's gradient; verify must say so, with the size, and attribute it to BatchNorm. Its running
statistics r get one update r <- (1 - m) r + m s(batch) per forward. In training mode s(batch) does
not depend on r, so after a window of N micro-batches with momentum m'

    r_N = (1 - m')^N r_0 + (terms that do not depend on r_0)

and a change of r_0 survives as (1 - m')^N times itself: (1 - m) for one full-batch update, and
for m' = 1 - (1 - m)^(1/N) (correct_batchnorm_momentum=True). Tolerance for that float64 identity:
rtol 1e-10, atol 1e-12 (a handful of multiply-adds per element).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.accumulate.batchnorm import batchnorm_layers
from microbatch.models.workloads import cnn_bn
from microbatch.trees.batches import split_batch
from microbatch.verification.check import verify

F64 = {"rtol": 1e-10, "atol": 1e-12}
STATISTICS = ("running_mean", "running_var")


@pytest.fixture(scope="module")
def workload() -> mb.Workload:
    return cnn_bn()


def running_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{kind}": getattr(layer, kind).detach().clone()
        for name, layer in batchnorm_layers(model)
        for kind in STATISTICS
    }


def to_float64(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    return images.double(), labels


def train_windows(
    workload: mb.Workload,
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    correct: bool,
) -> nn.Module:
    """One optimizer step per batch, each batch cut into ``steps`` micro-batches; lr 0 keeps the
    parameters fixed, so only the running statistics change."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = mb.Accumulator(model, optimizer, steps=steps, correct_batchnorm_momentum=correct)
    micro = [piece for batch in batches for piece in split_batch(batch, [batch[1].shape[0] // steps] * steps)]
    for m in acc.iterate(micro):
        loss, items = workload.loss(model, m.batch)
        acc.backward(loss, items=items)
        if m.is_last:
            acc.step()
    return model


def test_verify_reports_the_batchnorm_difference_with_its_size(workload: mb.Workload) -> None:
    report = verify(workload, batch=32, steps=4, dtype=torch.float64)
    assert not report.equivalent
    assert report.max_rel_diff > 1e-3  # far above float64 rounding: a real difference
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "batchnorm"]
    assert diagnostic.severity == "warning"
    assert diagnostic.details["layers"] == ["blocks.0.norm", "blocks.1.norm", "blocks.2.norm"]
    assert diagnostic.details["max_rel_diff"] == report.max_rel_diff
    assert f"{report.max_rel_diff:.2e}" in diagnostic.message  # the size, as the user reads it
    # Frozen BatchNorm makes the difference vanish: it is BatchNorm's.
    assert diagnostic.details["frozen_max_rel_diff"] <= report.rtol
    assert diagnostic.details["running_stats_max_abs_diff"] > 0
    assert "convert_batchnorm_to_groupnorm" in diagnostic.message
    assert "batchnorm" in str(report)


@pytest.mark.parametrize("correct", [False, True])
def test_running_statistics_decay_as_one_full_batch_update(workload: mb.Workload, correct: bool) -> None:
    model = copy.deepcopy(workload.model).double()
    (momentum,) = {layer.momentum for _, layer in batchnorm_layers(model)}
    assert momentum == 0.1
    batch = to_float64(workload.make_batch(32))
    steps = 4

    shifted = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    delta = {}
    for name, layer in batchnorm_layers(shifted):
        for kind in STATISTICS:
            change = torch.rand(getattr(layer, kind).shape, generator=generator, dtype=torch.float64) + 0.5
            getattr(layer, kind).add_(change)
            delta[f"{name}.{kind}"] = change

    def decayed_change(steps: int, correct: bool) -> dict[str, torch.Tensor]:
        """How much of the change of the old statistics survives one window."""
        base = running_stats(train_windows(workload, model, [batch], steps=steps, correct=correct))
        moved = running_stats(train_windows(workload, shifted, [batch], steps=steps, correct=correct))
        return {name: moved[name] - base[name] for name in base}

    # One full-batch update: a change of the old statistics survives as (1 - m) times itself.
    for name, survived in decayed_change(1, False).items():
        torch.testing.assert_close(survived, (1 - momentum) * delta[name], **F64)
    decay = (1 - momentum) if correct else (1 - momentum) ** steps  # 0.9, or 0.9^4 = 0.6561 uncorrected
    for name, survived in decayed_change(steps, correct).items():
        torch.testing.assert_close(survived, decay * delta[name], **F64)


def test_momentum_correction_tracks_full_batch_statistics_on_digits(workload: mb.Workload) -> None:
    """Three optimizer steps on 8x8 digits, 32 images each, as 4 micro-batches of 8.

    The corrected statistics differ from the full batch's only in how each window weighs its
    micro-batches' statistics (m'(1 - m')^(N-1-j) instead of m / N each) and in the variance within
    micro-batches versus across the batch. Measured: 1.4x the full-batch change uncorrected, 4e-4x
    corrected (8 micro-batches of 8, 5 steps).
    """
    model = copy.deepcopy(workload.model).double()
    batches = [to_float64(workload.make_batch(32)) for _ in range(3)]
    initial = running_stats(model)
    full = running_stats(train_windows(workload, model, batches, steps=1, correct=False))
    errors = {}
    for correct in (False, True):
        stats = running_stats(train_windows(workload, model, batches, steps=4, correct=correct))
        for kind in STATISTICS:
            names = [name for name in full if name.endswith(kind)]
            moved = max(float((full[n] - initial[n]).abs().max()) for n in names)
            errors[correct, kind] = max(float((stats[n] - full[n]).abs().max()) for n in names) / moved
    for kind in STATISTICS:
        assert errors[False, kind] > 0.5, errors  # N updates per window: far off
        assert errors[True, kind] < 0.02, errors  # one update per window's worth of decay
