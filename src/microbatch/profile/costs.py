"""What profiling measured: costs as functions of the micro-batch size, per segment and policy."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..memory import format_bytes

NONE = "none"
# A fit is "linear" when it misses no measurement by more than this fraction of the largest value
# (measurements below the absolute floors are noise and always fit).
LINEAR_TOLERANCE = 0.10
BYTES_FLOOR = 64 * 1024
SECONDS_FLOOR = 2e-3


def chain_peak(parts: Sequence[tuple[float, float]]) -> float:
    """Peak of a chain of segments run in order, each as (kept_bytes, peak_bytes).

    Segment k peaks at peak_k above what the segments before it keep saved for backward, P_{k-1} =
    kept_1 + ... + kept_{k-1}; the chain's peak is max_k (P_{k-1} + peak_k). The one definition:
    the profile's slack and the planner's solver (planner/search/solve.py) both evaluate it here.
    """
    kept, peak = 0.0, 0.0
    for kept_bytes, peak_bytes in parts:
        peak = max(peak, kept + peak_bytes)
        kept += kept_bytes
    return peak


@dataclass(frozen=True)
class Fit:
    """A cost as a function of the micro-batch size b, from measurements at a few sizes.

    ``intercept + slope * b`` is the least-squares line (what ``is_linear`` judges). With
    ``interpolate`` the value is instead the piecewise-linear curve through the measurements,
    extended beyond them along the nearest piece: byte counts are a maximum over moments of lines
    in b (a fixed-size temporary wins at small b, activations at large b), a convex function, and
    the chords between measurements lie on or above it.

    ``line_beyond`` (times): through the measurements inside their range, and beyond it along the
    least-squares slope from the nearest measurement. A plan of micro-batches of a profiled size is
    then priced by what that size measured: the line's value at b = 1 moves with the noise of the
    larger sizes, and 64 micro-batches of 1 multiply it by 64 (gpt-mini on CPU, 6 profiles: the
    line put 1 x 64 anywhere in 0.50-0.61 s, the measurements in 0.57-0.61 s). Beyond the range
    the slope over all sizes is steadier than the last piece's.
    """

    intercept: float
    slope: float
    sizes: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    interpolate: bool = False
    line_beyond: bool = False

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        values: Sequence[float],
        *,
        nonnegative: bool = False,
        interpolate: bool = False,
        line_beyond: bool = False,
    ) -> Fit:
        """Least squares; ``nonnegative`` keeps intercept and slope >= 0 (a time cannot shrink with b)."""
        if len(sizes) != len(values) or not sizes:
            raise ConfigError("Fit.of needs as many values as sizes, at least one")
        pairs = sorted(zip(sizes, values, strict=True))
        xs, ys = [float(s) for s, _ in pairs], [float(v) for _, v in pairs]
        n = len(xs)
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        spread = sum((x - mean_x) ** 2 for x in xs)
        # Least squares: slope = cov(x, y) / var(x); a single size gives a constant.
        slope = (
            sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
        )
        intercept = mean_y - slope * mean_x
        if nonnegative and (slope < 0 or intercept < 0):
            # The best line with the offending coefficient at zero: through the origin, or flat.
            if slope < 0:
                slope, intercept = 0.0, max(0.0, mean_y)
            else:
                squares = sum(x * x for x in xs)
                slope, intercept = max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / squares), 0.0
        return cls(intercept, slope, tuple(int(s) for s, _ in pairs), tuple(ys), interpolate, line_beyond)

    @classmethod
    def constant(cls, value: float) -> Fit:
        return cls(float(value), 0.0)

    def line(self, micro_batch_size: float) -> float:
        return self.intercept + self.slope * micro_batch_size

    def __call__(self, micro_batch_size: float) -> float:
        """The predicted value at ``micro_batch_size``, never below zero (a cost cannot be negative)."""
        if not self.interpolate or len(self.sizes) < 2:
            return max(0.0, self.line(micro_batch_size))
        xs, ys = self.sizes, self.values
        if self.line_beyond and not xs[0] <= micro_batch_size <= xs[-1]:
            nearest = 0 if micro_batch_size < xs[0] else -1
            return max(0.0, ys[nearest] + self.slope * (micro_batch_size - xs[nearest]))
        # The piece that holds b, or the first / last piece beyond the measured sizes.
        index = 1
        while index < len(xs) - 1 and micro_batch_size > xs[index]:
            index += 1
        x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
        return max(0.0, y0 + (y1 - y0) * (micro_batch_size - x0) / (x1 - x0))

    def relative_miss(self) -> float:
        """Largest |line - measured| over the largest |measured|: 0 for a perfect line."""
        if not self.values:
            return 0.0
        scale = max(abs(v) for v in self.values)
        if scale == 0:
            return 0.0
        return max(abs(self.line(s) - v) for s, v in zip(self.sizes, self.values, strict=True)) / scale

    def is_linear(self, *, floor: float) -> bool:
        if not self.values or max(abs(v) for v in self.values) < floor:
            return True
        return self.relative_miss() <= LINEAR_TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        return {
            "intercept": self.intercept,
            "slope": self.slope,
            "sizes": list(self.sizes),
            "values": list(self.values),
            "interpolate": self.interpolate,
            "line_beyond": self.line_beyond,
        }


@dataclass(frozen=True)
class PolicyCost:
    """A segment's costs under one policy, each as a function of the micro-batch size.

    ``kept_bytes`` and ``peak_bytes`` are the steady state, from the second call of a checkpointed
    block on. ``first_kept_bytes`` and ``first_peak_bytes`` are its first call, where they differ:
    a selective checkpoint learns in its first recompute which outputs it need not keep, so the
    first forward of a freshly checkpointed block can keep more.
    """

    kept_bytes: Fit
    peak_bytes: Fit
    forward_seconds: Fit
    backward_seconds: Fit
    first_kept_bytes: Fit | None = None
    first_peak_bytes: Fit | None = None

    def seconds(self, micro_batch_size: float) -> float:
        return self.forward_seconds(micro_batch_size) + self.backward_seconds(micro_batch_size)

    def kept(self, micro_batch_size: float, *, first: bool = False) -> float:
        fit = self.first_kept_bytes if first and self.first_kept_bytes is not None else self.kept_bytes
        return fit(micro_batch_size)

    def peak(self, micro_batch_size: float, *, first: bool = False) -> float:
        fit = self.first_peak_bytes if first and self.first_peak_bytes is not None else self.peak_bytes
        return fit(micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "kept_bytes": self.kept_bytes.to_dict(),
            "peak_bytes": self.peak_bytes.to_dict(),
            "forward_seconds": self.forward_seconds.to_dict(),
            "backward_seconds": self.backward_seconds.to_dict(),
        }
        if self.first_kept_bytes is not None and self.first_peak_bytes is not None:
            data["first_kept_bytes"] = self.first_kept_bytes.to_dict()
            data["first_peak_bytes"] = self.first_peak_bytes.to_dict()
        return data


@dataclass(frozen=True)
class SegmentProfile:
    """A block (``is_block``) or a part outside the blocks, with its costs per policy.

    Parts outside blocks have only the policy "none". ``gradient_bytes`` is the gradient memory of
    the parameters whose gradients this segment's backward creates. ``freed_input_bytes``: the
    block's input, which dies after it without checkpointing and is credited to its "none"
    kept_bytes (assemble.fold_freed_inputs); a caller that holds the input (a pipeline stage's
    receive buffer) adds it back.
    """

    name: str
    is_block: bool
    costs: Mapping[str, PolicyCost]
    boundary_bytes: Fit = field(default_factory=lambda: Fit.constant(0))
    gradient_bytes: int = 0
    freed_input_bytes: Fit = field(default_factory=lambda: Fit.constant(0))

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(self.costs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "is_block": self.is_block,
            "boundary_bytes": self.boundary_bytes.to_dict(),
            "gradient_bytes": self.gradient_bytes,
            "freed_input_bytes": self.freed_input_bytes.to_dict(),
            "costs": {policy: cost.to_dict() for policy, cost in self.costs.items()},
        }


@dataclass(frozen=True)
class Profile:
    """What profiling measured; the planner's only view of the model.

    ``base_bytes``: live bytes at a micro-batch's forward start besides parameters, gradients and
    optimizer state (the micro-batch and the next one the loop holds). ``step_peak_bytes``: the
    most bytes the optimizer step allocates above the static memory. ``loop_seconds``: time per
    micro-batch outside the segments (making the batch, the loss's bookkeeping). ``slack_bytes``:
    how far the measured peak of the profiled runs exceeded the model's own prediction for them.
    """

    name: str
    device: str
    micro_batch_sizes: tuple[int, ...]
    segments: tuple[SegmentProfile, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_name: str
    base_bytes: Fit
    step_peak_bytes: int
    step_seconds: float
    loop_seconds: Fit
    slack_bytes: int = 0
    profile_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    # How far the profile's (fastest-round) times could move if profiled again: the median gap
    # between each run's two fastest timed rounds, relative (assemble.time_noise), after rounds
    # were repeated until it settled (measure.py). The planner's ties are no wider than this.
    time_noise: float = 0.0
    # On CUDA (real or simulated): reserved minus live bytes of the profiled runs at each size
    # (profile/reserved.py), which turns the live-byte prediction into reserved bytes; None off CUDA.
    reserved_overhead_bytes: Fit | None = None
    peak_kind: str = "live tensor bytes"  # or "reserved (allocator model)" / "(expandable segments)"
    # What the times were read from: "wall" or "cpu", the profiling thread's CPU time (clocks.py).
    clock: str = "wall"
    # The gradients' name in the peak's parts (the planner names FSDP's unsharded gradients).
    gradient_name: str = "gradients"
    # The step's temporaries' name in the peak's parts (the planner names FSDP's per-shard step).
    step_peak_name: str = "optimizer step temporaries"
    # Bytes per element of the floating parameters FSDP all-gathers (FSDP2 MixedPrecisionPolicy's
    # param_dtype: 2 for bf16), or None: their own dtype's.
    gather_itemsize: int | None = None
    # True when the gradients' bytes stay held between windows, so that even a window's first
    # micro-batch runs with all of them under it (FSDP2's gradient shards: planner/target/per_rank.py).
    gradients_held: bool = False

    def reserved_overhead(self, micro_batch_size: float) -> int:
        """Bytes the caching allocator reserves beyond the live tensors at ``micro_batch_size`` (0 off
        CUDA): through the profiled sizes piecewise linearly, beyond them along the nearest piece but
        never below the least measured value (segments of tensors that grow with b waste more or as
        much; a few small tensors waste a constant share of a 2 MiB segment)."""
        fit = self.reserved_overhead_bytes
        if fit is None:
            return 0
        return math.ceil(max(fit(micro_batch_size), min(fit.values, default=0.0)))

    @property
    def static_bytes(self) -> int:
        """Parameters + gradients + optimizer state: live through every micro-batch of a window."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def blocks(self) -> tuple[SegmentProfile, ...]:
        return tuple(segment for segment in self.segments if segment.is_block)

    @property
    def policies(self) -> tuple[str, ...]:
        found: list[str] = []
        for segment in self.blocks:
            found.extend(policy for policy in segment.policies if policy not in found)
        return tuple(found)

    def static_parts(self) -> dict[str, int]:
        return {
            "parameters": self.parameter_bytes,
            self.gradient_name: self.gradient_bytes,
            f"{self.optimizer_name} state": self.optimizer_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "optimizer_name": self.optimizer_name,
            "base_bytes": self.base_bytes.to_dict(),
            "step_peak_bytes": self.step_peak_bytes,
            "step_seconds": self.step_seconds,
            "loop_seconds": self.loop_seconds.to_dict(),
            "slack_bytes": self.slack_bytes,
            "profile_seconds": self.profile_seconds,
            "clock": self.clock,
            "notes": list(self.notes),
            "segments": [segment.to_dict() for segment in self.segments],
            "reserved_overhead_bytes": (
                self.reserved_overhead_bytes.to_dict() if self.reserved_overhead_bytes is not None else None
            ),
            "peak_kind": self.peak_kind,
        }

    def __str__(self) -> str:
        b = max(self.micro_batch_sizes) if self.micro_batch_sizes else 1
        lines = [
            f"Profile of {self.name} on {self.device} at micro-batch sizes "
            f"{', '.join(map(str, self.micro_batch_sizes))} ({self.profile_seconds:.1f} s)",
            "static: " + " + ".join(f"{k} {format_bytes(v)}" for k, v in self.static_parts().items()),
            f"per segment at micro-batch {b}:",
            f"  {'segment':<24} {'policy':<10} {'kept':>10} {'peak':>10} {'fwd ms':>8} {'bwd ms':>8}",
        ]
        for segment in self.segments:
            for policy, cost in segment.costs.items():
                lines.append(
                    f"  {segment.name:<24} {policy:<10} {format_bytes(cost.kept_bytes(b)):>10} "
                    f"{format_bytes(cost.peak_bytes(b)):>10} {1e3 * cost.forward_seconds(b):>8.2f} "
                    f"{1e3 * cost.backward_seconds(b):>8.2f}"
                )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def profile_from_dict(data: Mapping[str, Any], *, time_noise: float = 0.0) -> Profile:
    """The Profile that ``Profile.to_dict`` wrote (a recorded profile, for tests and benchmarks);
    ``time_noise``, which to_dict does not hold, given apart."""

    def fit(values: Mapping[str, Any]) -> Fit:
        return Fit(
            float(values["intercept"]),
            float(values["slope"]),
            tuple(int(size) for size in values["sizes"]),
            tuple(float(value) for value in values["values"]),
            bool(values["interpolate"]),
            bool(values["line_beyond"]),
        )

    def cost(values: Mapping[str, Any]) -> PolicyCost:
        first = ("first_kept_bytes", "first_peak_bytes")
        firsts = [fit(values[name]) if name in values else None for name in first]
        times = (fit(values["forward_seconds"]), fit(values["backward_seconds"]))
        return PolicyCost(fit(values["kept_bytes"]), fit(values["peak_bytes"]), *times, *firsts)

    segments = tuple(
        SegmentProfile(
            name=segment["name"],
            is_block=bool(segment["is_block"]),
            costs={policy: cost(values) for policy, values in segment["costs"].items()},
            boundary_bytes=fit(segment["boundary_bytes"]),
            gradient_bytes=int(segment["gradient_bytes"]),
            freed_input_bytes=fit(segment["freed_input_bytes"]),
        )
        for segment in data["segments"]
    )
    overhead = data.get("reserved_overhead_bytes")
    return Profile(
        name=str(data["name"]),
        device=str(data["device"]),
        optimizer_name=str(data["optimizer_name"]),
        peak_kind=str(data["peak_kind"]),
        clock=str(data["clock"]),
        parameter_bytes=int(data["parameter_bytes"]),
        gradient_bytes=int(data["gradient_bytes"]),
        optimizer_bytes=int(data["optimizer_bytes"]),
        micro_batch_sizes=tuple(int(size) for size in data["micro_batch_sizes"]),
        segments=segments,
        base_bytes=fit(data["base_bytes"]),
        step_peak_bytes=int(data["step_peak_bytes"]),
        step_seconds=float(data["step_seconds"]),
        loop_seconds=fit(data["loop_seconds"]),
        slack_bytes=int(data["slack_bytes"]),
        profile_seconds=float(data["profile_seconds"]),
        notes=tuple(data["notes"]),
        time_noise=time_noise,
        reserved_overhead_bytes=fit(overhead) if overhead is not None else None,
    )
