"""What ``verify`` reports: per-parameter differences, diagnostics, and the report itself.

The numbers are computed in passes.py (the comparison) and diagnostics.py (the
explanations); check.py puts them together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Diagnostic", "ParameterDifference", "VerifyReport"]


@dataclass(frozen=True)
class ParameterDifference:
    """Accumulated vs full-batch gradient of one parameter."""

    name: str
    shape: tuple[int, ...]
    reference_max_abs: float  # max |G|
    max_abs_diff: float  # max |a - G|
    max_rel_diff: float  # max |a - G| / max |G|

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Diagnostic:
    """One finding: ``kind`` is batchnorm, item-counts, items-mismatch, randomness, coupled, router_balance,
    precision or unexplained."""

    kind: str
    severity: str  # "info" or "warning"
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"[{self.severity}] {self.kind}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found. ``equivalent`` is True when max_rel_diff <= rtol."""

    workload: str
    batch: int
    steps: int
    micro_batch_sizes: tuple[int, ...]
    items: tuple[int, ...]  # per micro-batch, as the loss reported them
    dtype: str
    device: str
    rtol: float
    equivalent: bool
    max_abs_diff: float
    max_rel_diff: float
    l2_rel_diff: float  # ||a - G|| / ||G|| over all parameters
    naive_max_abs_diff: float  # the divide-by-steps recipe
    naive_max_rel_diff: float
    full_loss: float
    accumulated_loss: float  # the Accumulator's item-weighted window loss
    naive_loss: float  # mean of the micro-batch means
    randomness_control: str
    parameters: tuple[ParameterDifference, ...]
    diagnostics: tuple[Diagnostic, ...]

    @property
    def loss_diff(self) -> float:
        return abs(self.accumulated_loss - self.full_loss)

    @property
    def naive_loss_diff(self) -> float:
        return abs(self.naive_loss - self.full_loss)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["loss_diff"] = self.loss_diff
        data["naive_loss_diff"] = self.naive_loss_diff
        return data

    def __str__(self) -> str:
        sizes = _describe_sizes(self.micro_batch_sizes)
        verdict = (
            f"EQUAL within rounding (rtol {self.rtol:.0e})"
            if self.equivalent
            else f"DIFFERENT (rtol {self.rtol:.0e})"
        )
        lines = [
            f"verify {self.workload}: batch {self.batch} as {sizes} ({self.dtype}, {self.device})",
            f"items per micro-batch: {', '.join(map(str, self.items))} ({sum(self.items)} in all)",
            "",
            f"{'gradient vs full batch':<26}{'max abs diff':>14}{'max rel diff':>14}",
            f"{'microbatch (items=)':<26}{self.max_abs_diff:>14.2e}{self.max_rel_diff:>14.2e}  {verdict}",
            f"{'divide by steps':<26}{self.naive_max_abs_diff:>14.2e}{self.naive_max_rel_diff:>14.2e}",
            "",
            f"loss: full batch {self.full_loss:.8g}, microbatch {self.accumulated_loss:.8g} "
            f"(diff {self.loss_diff:.2e}), mean of micro-batch means {self.naive_loss:.8g} "
            f"(diff {self.naive_loss_diff:.2e})",
            f"randomness: {self.randomness_control}",
            "",
        ]
        lines += _parameter_table(self.parameters)
        if self.diagnostics:
            lines += ["", "diagnostics:"]
            lines += [f"  {diagnostic}" for diagnostic in self.diagnostics]
        return "\n".join(lines)


def _describe_sizes(sizes: tuple[int, ...]) -> str:
    if len(set(sizes)) == 1:
        return f"{len(sizes)} micro-batch{'es' if len(sizes) > 1 else ''} of {sizes[0]}"
    return f"{len(sizes)} micro-batches of {', '.join(map(str, sizes))}"


def _parameter_table(parameters: tuple[ParameterDifference, ...], *, limit: int = 20) -> list[str]:
    shown = list(parameters)
    hidden = 0
    if len(shown) > limit:  # keep the largest differences, in model order
        worst = sorted(shown, key=lambda p: p.max_rel_diff, reverse=True)[: limit // 2]
        keep = {p.name for p in worst}
        hidden = len(shown) - len(keep)
        shown = [p for p in shown if p.name in keep]
    width = max([9, *(len(p.name) for p in shown)]) + 2
    lines = [
        f"{'parameter':<{width}}{'shape':<16}{'max|full grad|':>15}{'max abs diff':>14}{'max rel diff':>14}"
    ]
    for p in shown:
        shape = "(" + ", ".join(map(str, p.shape)) + ("," if len(p.shape) == 1 else "") + ")"
        lines.append(
            f"{p.name:<{width}}{shape:<16}{p.reference_max_abs:>15.3e}{p.max_abs_diff:>14.2e}"
            f"{p.max_rel_diff:>14.2e}"
        )
    if hidden:
        lines.append(f"... {hidden} more parameters with smaller differences (--json lists all)")
    return lines
