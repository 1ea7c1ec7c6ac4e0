"""What verify says about precision: the compute dtype's tolerance, and fp32 accumulation.

Kept apart from check.py (one idea per module); verify turns these into Diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: str
    message: str
    details: dict[str, Any]


def compute_dtype_finding(
    compute: torch.dtype, parameter_dtype: torch.dtype, rtol: float, *, autocast_given: bool
) -> Finding:
    how = "under autocast=" if autocast_given else "detected: its matmuls return"
    name = str(compute).removeprefix("torch.")
    return Finding(
        "precision",
        "info",
        f"the workload computes in {name} ({how} {name}) with {str(parameter_dtype).removeprefix('torch.')} "
        f"parameters: gradients carry {name} rounding in both passes, so the tolerance comes from the "
        f"compute dtype (rtol {rtol:.0e}), not the parameters'",
        {"compute_dtype": name, "rtol": rtol},
    )


def wide_accumulation_finding(
    parameter_dtype: torch.dtype, steps: int, max_rel: float, wide_max_rel: float, rtol: float
) -> Finding:
    name = str(parameter_dtype).removeprefix("torch.")
    helps = wide_max_rel < max_rel
    verdict = (
        f"Accumulator(..., accumulate_dtype=torch.float32) sums them in float32 and rounds once: "
        f"max rel diff {wide_max_rel:.2e} instead of {max_rel:.2e}"
        if helps
        else f"accumulate_dtype=torch.float32 gives {wide_max_rel:.2e} here: no better"
    )
    return Finding(
        "precision",
        "warning" if helps and max_rel > rtol >= wide_max_rel else "info",
        f"{name} parameters: each of the {steps} micro-batches' gradients is added into a {name} .grad, "
        f"rounding at every addition; {verdict}",
        {"wide_max_rel_diff": wide_max_rel, "helps": helps},
    )
