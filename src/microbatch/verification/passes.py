"""The passes ``verify`` compares, run from the same parameters, and the comparison itself.

    full batch          loss(model, batch).backward()              the reference G
    microbatch          Accumulator: sum_i(items_i * g_i) / T      what microbatch computes
    divide by steps     sum_i(g_i) / N                             the usual recipe

Each pass runs on a private deep copy of the model, from a given seed. Differences are
max|a - G| and max|a - G| / max|G| per parameter (relative to the parameter's largest gradient
entry, so entries near zero do not blow it up), and overall, with ||a - G|| / ||G||.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accumulate.accumulator import Accumulator
from ..errors import WorkloadError
from ..trees.batches import map_tensors
from ..workload import LossFn
from .report import ParameterDifference

Grads = dict[str, torch.Tensor]


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating-point tensors in ``dtype`` (integer tensors as they are)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def run_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    result = loss_fn(model, batch)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise WorkloadError("the workload's loss(model, batch) must return a pair (loss, items)")
    loss, items = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise WorkloadError(
            "the workload's loss must be a scalar tensor that requires grad (a mean over the batch's "
            f"items), got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
        )
    count = float(items.item()) if isinstance(items, torch.Tensor) else float(items)
    if not (count > 0 and count == int(count)):
        raise WorkloadError(f"the workload's loss reported items={count:g}; items must be a whole count > 0")
    return loss, int(count)


def _grads(model: nn.Module) -> Grads:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}


@dataclass
class Pass:
    grads: Grads
    loss: float
    buffers: dict[str, torch.Tensor]
    loss_dtype: torch.dtype = torch.float32
    items: int = 0  # the full batch's item count, as its loss reported it


def run_full_batch(base: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> Pass:
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    loss, items = run_loss(loss_fn, model, batch)
    loss.backward()
    grads = _grads(model)
    if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
        raise WorkloadError("the full-batch gradient is not finite (inf or nan); fix the loss, then verify")
    return Pass(grads, float(loss.detach()), _float_buffers(model), loss.dtype, items)


def run_accumulated(
    base: nn.Module, loss_fn: LossFn, micro: list[Any], seed: int, accumulate_dtype: torch.dtype | None = None
) -> Pass:
    """The Accumulator's window gradient, captured just before its (lr=0) optimizer step."""
    model = copy.deepcopy(base)
    captured: Grads = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(lambda *_: captured.update(_grads(model)))
    acc = Accumulator(model, optimizer, steps=len(micro), accumulate_dtype=accumulate_dtype)
    torch.manual_seed(seed)
    window_loss = math.nan
    for m in acc.iterate(micro):
        loss, items = run_loss(loss_fn, model, m.batch)
        acc.backward(loss, items=items)
        if m.is_last:
            window_loss = acc.step().loss
    if not captured:  # the Accumulator skipped its step: the gradient was not finite
        raise WorkloadError("the accumulated gradient is not finite (inf or nan); fix the loss, then verify")
    return Pass(captured, window_loss, _float_buffers(model))


@dataclass
class PerMicro:
    naive: Pass
    items: list[int]
    columns: list[torch.Tensor] | None  # flattened float64 g_i, when small enough to keep


def run_per_micro_batch(
    base: nn.Module, loss_fn: LossFn, micro: list[Any], seed: int, *, keep_columns: bool
) -> PerMicro:
    """Each micro-batch's own gradient g_i; their mean is the divide-by-steps recipe."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    naive: Grads | None = None
    losses, items, columns = [], [], []
    for piece in micro:
        model.zero_grad(set_to_none=True)
        loss, count = run_loss(loss_fn, model, piece)
        loss.backward()
        grads = _grads(model)
        losses.append(float(loss.detach()))
        items.append(count)
        if keep_columns:
            columns.append(torch.cat([g.detach().double().flatten().cpu() for g in grads.values()]))
        if naive is None:
            naive = {name: g / len(micro) for name, g in grads.items()}
        else:
            for name, g in grads.items():
                naive[name] += g / len(micro)
    naive_pass = Pass(naive or {}, sum(losses) / len(losses), _float_buffers(model))
    return PerMicro(naive_pass, items, columns if keep_columns else None)


@dataclass
class Difference:
    max_abs: float
    max_rel: float
    l2_rel: float
    per_parameter: tuple[ParameterDifference, ...]


def compare(actual: Grads, expected: Grads) -> Difference:
    rows, diff_sq, ref_sq = [], 0.0, 0.0
    overall_abs, overall_ref = 0.0, 0.0
    for name, reference in expected.items():
        ref = reference.double()
        diff = (actual[name].double() - ref).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        rows.append(ParameterDifference(name, tuple(ref.shape), ref_max, max_abs, _ratio(max_abs, ref_max)))
        overall_abs, overall_ref = max(overall_abs, max_abs), max(overall_ref, ref_max)
        diff_sq += float(diff.pow(2).sum())
        ref_sq += float(ref.pow(2).sum())
    return Difference(
        overall_abs,
        _ratio(overall_abs, overall_ref),
        _ratio(math.sqrt(diff_sq), math.sqrt(ref_sq)),
        tuple(rows),
    )


def _ratio(numerator: float, denominator: float) -> float:
    if denominator > 0:
        return numerator / denominator
    return 0.0 if numerator == 0 else math.inf


@dataclass
class Compared:
    """The passes from one set of parameters and their differences from the full batch's gradient."""

    full: Pass
    accumulated: Pass  # microbatch's Accumulator
    per_micro: PerMicro  # each micro-batch alone; their mean is the divide-by-steps recipe
    diff: Difference  # accumulated vs full
    naive: Difference  # divide by steps vs full
