"""Prove, for a user's own model and loss, that accumulation gives the full-batch gradient.

From the same parameters, one batch of B samples is run three ways:

    full batch          loss(model, batch).backward()              the reference G
    microbatch          Accumulator: sum_i(items_i * g_i) / T      what microbatch computes
    divide by steps     sum_i(g_i) / N                             the usual recipe (seed documents)

where g_i is the gradient of micro-batch i's mean loss, items_i its item count and T = sum_i items_i.
For a mean loss over independent items, G = sum_i (items_i / T) g_i exactly, so microbatch must
match G up to rounding; the usual recipe matches only when every micro-batch carries as many items.

Differences are reported per parameter as max|a - G| and max|a - G| / max|G| (relative to the
parameter's largest gradient entry, so entries near zero do not blow it up), and overall.
Diagnostics explain a difference instead of just reporting it: randomness, item counts, BatchNorm,
a loss that miscounts its items, samples coupled within a batch, precision.

Here: the arguments, the default tolerance, and the order of the passes. The passes and the
comparison: passes.py; the diagnostics: diagnostics.py (precision: tolerances.py);
the report: report.py.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import Any

import torch
from torch import nn

from ..accumulate.precision import compute_dtype, low_precision_parameters, with_autocast
from ..errors import ConfigError, WorkloadError
from ..trees.batches import batch_size_of, move_batch, split_batch
from ..workload import Workload
from .diagnostics import IGNORE_INDEX, Setup, control_randomness, diagnose
from .passes import (
    Compared,
    Difference,
    Pass,
    cast_floating,
    compare,
    run_accumulated,
    run_full_batch,
    run_per_micro_batch,
)
from .report import Diagnostic, ParameterDifference, VerifyReport
from .tolerances import Finding, compute_dtype_finding, wide_accumulation_finding

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RTOL", "IGNORE_INDEX", "Diagnostic", "ParameterDifference", "VerifyReport", "verify"]

# Largest storage for the per-micro-batch gradients kept for the least-squares fit (float64).
FIT_MAX_BYTES = 256 * 2**20
# Default relative tolerance (max|a - G| / max|G|) per dtype: well above rounding, far below the
# differences a real mistake causes (1e-3 and up).
DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}


def _even_sizes(batch: int, steps: int) -> list[int]:
    base, extra = divmod(batch, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _check_arguments(workload: object, batch: int, steps: int, rtol: float | None) -> None:
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload must be a microbatch.Workload, got {type(workload).__name__}")
    for name, value in (("batch", batch), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if steps > batch:
        raise ConfigError(f"steps ({steps}) must be <= batch ({batch}): every micro-batch needs a sample")
    if rtol is not None and not (isinstance(rtol, (int, float)) and rtol > 0 and math.isfinite(rtol)):
        raise ConfigError(f"rtol must be a positive finite number, got {rtol!r}")


def _prepare(workload: Workload, batch: int, dtype: torch.dtype | None) -> tuple[nn.Module, Any]:
    """A private copy of the model in training mode, and one batch of ``batch`` samples on its device."""
    base = copy.deepcopy(workload.model)
    if dtype is not None:
        base.to(dtype)
    base.train()
    full_batch = move_batch(workload.make_batch(batch), workload.device)
    if dtype is not None:
        full_batch = cast_floating(full_batch, dtype)
    if batch_size_of(full_batch) != batch:
        raise WorkloadError(
            f"make_batch({batch}) returned a batch of {batch_size_of(full_batch)} samples; "
            "it must return exactly the number asked for"
        )
    return base, full_batch


def _default_rtol(
    parameter_dtype: torch.dtype, loss_dtype: torch.dtype, compute: torch.dtype | None
) -> float:
    # The comparison is only as sharp as the coarser of the parameters and the loss: a model
    # may compute its loss in float32 inside a float64 model (transformers does), or its
    # matmuls in bfloat16 under autocast.
    rtol = max(DEFAULT_RTOL.get(parameter_dtype, 1e-5), DEFAULT_RTOL.get(loss_dtype, 1e-5))
    if compute is not None:
        rtol = max(rtol, DEFAULT_RTOL.get(compute, 1e-2))
    return rtol


def _keep_columns(full: Pass, steps: int, deterministic: bool) -> bool:
    """Whether to keep each micro-batch's gradient for the least-squares fit of their weights."""
    num_values = sum(g.numel() for g in full.grads.values())
    # The fit means something only with many more gradient entries than micro-batches.
    return deterministic and 1 < steps <= num_values // 4 and num_values * steps * 8 <= FIT_MAX_BYTES


def _precision(
    setup: Setup, full: Pass, diff: Difference, compute: torch.dtype | None, *, autocast: bool
) -> list[Diagnostic]:
    """The compute dtype's tolerance, and whether float32 accumulation would help (measured, not guessed)."""
    findings: list[Finding] = []
    parameter_dtype = next((p.dtype for p in setup.base.parameters()), torch.float32)
    if compute is not None:
        findings.append(compute_dtype_finding(compute, parameter_dtype, setup.rtol, autocast_given=autocast))
    low = low_precision_parameters(setup.base.parameters())
    steps = len(setup.micro)
    if low is not None and steps > 1:
        wide_pass = run_accumulated(setup.base, setup.loss_fn, setup.micro, setup.seed, torch.float32)
        wide = compare(wide_pass.grads, full.grads)
        findings.append(wide_accumulation_finding(low, steps, diff.max_rel, wide.max_rel, setup.rtol))
    return [Diagnostic(f.kind, f.severity, f.message, f.details) for f in findings]


def _report(
    name: str,
    setup: Setup,
    compared: Compared,
    *,
    sizes: list[int],
    device: torch.device,
    control: str,
    diagnostics: list[Diagnostic],
) -> VerifyReport:
    full, accumulated, diff, naive = compared.full, compared.accumulated, compared.diff, compared.naive
    parameter_dtype = next((p.dtype for p in setup.base.parameters()), torch.float32)
    return VerifyReport(
        workload=name,
        batch=sum(sizes),
        steps=len(sizes),
        micro_batch_sizes=tuple(sizes),
        items=tuple(compared.per_micro.items),
        dtype=str(parameter_dtype).removeprefix("torch."),
        device=str(device),
        rtol=setup.rtol,
        equivalent=diff.max_rel <= setup.rtol,
        max_abs_diff=diff.max_abs,
        max_rel_diff=diff.max_rel,
        l2_rel_diff=diff.l2_rel,
        naive_max_abs_diff=naive.max_abs,
        naive_max_rel_diff=naive.max_rel,
        full_loss=full.loss,
        accumulated_loss=accumulated.loss,
        naive_loss=compared.per_micro.naive.loss,
        randomness_control=control,
        parameters=diff.per_parameter,
        diagnostics=tuple(diagnostics),
    )


def verify(
    workload: Workload,
    *,
    batch: int = 32,
    steps: int = 4,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    seed: int = 0,
    autocast: torch.dtype | None = None,
) -> VerifyReport:
    """Compare microbatch's accumulated gradient with the full-batch gradient, from the same parameters.

    ``batch`` samples from one ``workload.make_batch(batch)`` call are cut into ``steps`` micro-batches
    as evenly as possible. ``dtype`` runs the comparison in another precision (float64 makes it sharp;
    the batch's floating tensors are cast too). ``rtol`` bounds max|a - G| / max|G| (default by dtype,
    see DEFAULT_RTOL). The workload's model, its modes and the global RNG are left untouched.
    ``autocast`` (torch.bfloat16 / torch.float16) runs the loss under torch.autocast; autocast inside the
    loss is detected. Either way the default rtol comes from the compute dtype (verification/tolerances.py).
    """
    _check_arguments(workload, batch, steps, rtol)
    device = workload.device
    loss_fn = workload.loss if autocast is None else with_autocast(workload.loss, device.type, autocast)
    workload = dataclasses.replace(workload, loss=loss_fn)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        base, full_batch = _prepare(workload, batch, dtype)
        parameter_dtype = next((p.dtype for p in base.parameters()), torch.float32)
        sizes = _even_sizes(batch, steps)
        micro = split_batch(full_batch, sizes)
        control, deterministic = control_randomness(base, workload.loss, micro[0], seed)
        full = run_full_batch(base, workload.loss, full_batch, seed)
        compute = compute_dtype(copy.deepcopy(base), workload.loss, micro[0])
        if rtol is None:
            rtol = _default_rtol(parameter_dtype, full.loss_dtype, compute)
        setup = Setup(base=base, loss_fn=workload.loss, batch=full_batch, micro=micro, seed=seed, rtol=rtol)
        keep_columns = _keep_columns(full, steps, deterministic)
        per_micro = run_per_micro_batch(base, workload.loss, micro, seed, keep_columns=keep_columns)
        accumulated = run_accumulated(base, workload.loss, micro, seed)
        diff = compare(accumulated.grads, full.grads)
        compared = Compared(full, accumulated, per_micro, diff, compare(per_micro.naive.grads, full.grads))
        precision = _precision(setup, full, diff, compute, autocast=autocast is not None)
        diagnostics = [*precision, *diagnose(setup, compared, control=control, deterministic=deterministic)]
    return _report(
        workload.name, setup, compared, sizes=sizes, device=device, control=control, diagnostics=diagnostics
    )
