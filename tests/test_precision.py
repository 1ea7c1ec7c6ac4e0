"""Mixed precision: verify's tolerance from the compute dtype, and float32 accumulation of bf16 gradients.

Accumulation reference: the same bf16 micro-batch gradients summed exactly in float64; float32
accumulation must be within one bf16 rounding (2^-8 relative to the largest entry) and closer than
bf16 accumulation over 16 micro-batches. Its memory cost is measured with MemoryTracker and must
stay within the float32 sums' bytes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from microbatch.errors import ConfigError


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(dtype)


def _workload(model: nn.Module, *, autocast_inside: bool) -> mb.Workload:
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 16, generator=generator), torch.randn(size, 1, generator=generator)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        dtype = next(module.parameters()).dtype
        if autocast_inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = module(x)
        else:
            out = module(x.to(dtype))
        return F.mse_loss(out.float(), y), int(x.shape[0])

    return mb.Workload(model=model, make_batch=make_batch, loss=loss, name="mlp")


@pytest.mark.parametrize("how", ["autocast inside the loss", "autocast= argument"])
def test_verify_takes_its_tolerance_from_the_compute_dtype(how: str) -> None:
    inside = how == "autocast inside the loss"
    workload = _workload(_mlp(), autocast_inside=inside)
    report = mb.verify(workload, batch=32, steps=4, autocast=None if inside else torch.bfloat16)
    assert report.max_rel_diff > 1e-5  # float32's tolerance would have said DIFFERENT
    assert report.rtol == 1e-2 and report.equivalent
    precision = [d for d in report.diagnostics if d.kind == "precision"]
    assert precision and "bfloat16" in precision[0].message and "compute dtype" in precision[0].message


def test_verify_without_autocast_keeps_float32_tolerance() -> None:
    report = mb.verify(_workload(_mlp(), autocast_inside=False), batch=16, steps=4)
    assert report.rtol == 1e-5 and not any(d.kind == "precision" for d in report.diagnostics)


def _window(model: nn.Module, chunks: list[torch.Tensor], targets: list[torch.Tensor], **options: Any) -> Any:
    """(the window gradient before the optimizer step, the peak bytes of the window)."""
    captured: dict[str, torch.Tensor] = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(
        lambda *_: captured.update({n: p.grad.clone() for n, p in model.named_parameters()})
    )
    accumulator = mb.Accumulator(model, optimizer, steps=len(chunks), **options)
    with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
        for x, y in zip(chunks, targets, strict=True):
            accumulator.backward(F.mse_loss(model(x).float(), y), items=x.shape[0])
        accumulator.step()
    return captured, tracker.peak_bytes


def test_float32_accumulation_rounds_once_and_costs_its_sums() -> None:
    # Reference: the same bf16 micro-batch gradients (each weighted 1/steps, as the Accumulator does
    # with equal micro-batches) summed exactly in float64. What remains is the accumulation's rounding.
    steps = 16
    base = _mlp(torch.bfloat16)
    x, y = torch.randn(steps * 4, 16).to(torch.bfloat16), torch.randn(steps * 4, 1)
    chunks, targets = list(x.chunk(steps)), list(y.chunk(steps))
    exact = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in base.named_parameters()}
    for chunk, target in zip(chunks, targets, strict=True):
        model = copy.deepcopy(base)
        (F.mse_loss(model(chunk).float(), target) / steps).backward()
        for n, p in model.named_parameters():
            exact[n] += p.grad.double()
    plain, plain_peak = _window(copy.deepcopy(base), chunks, targets)
    wide, wide_peak = _window(copy.deepcopy(base), chunks, targets, accumulate_dtype=torch.float32)

    def error(grads: dict[str, torch.Tensor]) -> float:
        return max(float((grads[n].double() - g).abs().max() / g.abs().max()) for n, g in exact.items())

    assert all(g.dtype == torch.bfloat16 for g in wide.values())
    assert error(wide) <= 2.0**-8  # one rounding to bf16 (8 bits of mantissa)
    assert error(wide) < error(plain)
    # The float32 sums (4 bytes per parameter) live while the bf16 .grad is freed between micro-batches.
    numel = sum(p.numel() for p in base.parameters())
    assert 0 < wide_peak - plain_peak <= 4 * numel, (wide_peak - plain_peak, numel)


def test_verify_says_when_float32_accumulation_would_help() -> None:
    workload = _workload(_mlp(torch.bfloat16), autocast_inside=False)
    report = mb.verify(workload, batch=64, steps=16)
    found = [d for d in report.diagnostics if d.kind == "precision" and "accumulate_dtype" in d.message]
    assert found and found[0].details["wide_max_rel_diff"] <= report.max_rel_diff


def test_accumulate_dtype_is_checked() -> None:
    model = _mlp(torch.bfloat16)
    with pytest.raises(ConfigError, match="accumulate_dtype"):
        mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate_dtype=torch.int32)


def test_command_line_autocast(capsys: pytest.CaptureFixture[str]) -> None:
    from microbatch.cli import main

    code = main(["verify", "seed-linear", "--batch", "16", "--steps", "4", "--autocast", "bf16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["rtol"] == 1e-2
    assert any(d["kind"] == "precision" for d in report["diagnostics"])
