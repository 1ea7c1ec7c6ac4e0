"""The peak and time model of a plan: a choice of micro-batch sizes and block policies, priced.

A plan runs a rank's share of the batch, B_rank = B / W samples, as N micro-batches of sizes
micro_batch_sizes(B_rank, b) = [b] * (N - 1) + [r] with N = ceil(B_rank / b) and 0 < r <= b, or
the same N balanced (windows.WindowSizes), so the effective batch is exactly B. With the profile's
fits, for a choice o (one policy per block):

    seconds_per_step = sum over micro-batches m of (loop(m) + sum_k seconds_k(o_k, m)) + step
    peak_bytes       = max(parameters + optimizer state + base(b) + (1 + margin) * chain peak,
                           static + base(b) + step_peak) + slack + correction
    chain peak       = max_k (P_{k-1} + peak_k(o_k, b) + G_k)

(solve.py defines P_k and the activation term). G_k is the gradient memory live while segment k
runs: all gradients from a window's second micro-batch on (the earlier ones created them); in
its first, only those of the segments after k (backward creates them in reverse order; k's own
are in its measured peak). Gradients held between windows (FSDP2's shards, planner/target/per_rank.py)
are live under every micro-batch, as the parameters are: G_k = 0, and they join the bytes
under the chain (outside the safety margin, a share of the chain's peak). The first micro-batch
also differs in that a checkpoint may keep more on its first call (selective learns what to
skip in its first recompute). So a choice is priced in both phases (Model.price), and its chain
peak is the larger.

(sizes.py searches over this model.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...profile import NONE, Profile
from . import solve
from .splits import WindowSizes, size_counts

MEMO_ENTRIES = 16  # chains and base times a Model keeps (those of the sizes being priced)
STEADY, FIRST, BOTH = "steady", "first", "both"  # phases of a window; see Model.chain
# Added to the chain's peak: the loop's few scalars from earlier micro-batches, and the fits'
# error beyond the profiled sizes, stay under it.
SAFETY_MARGIN = 0.01
# Least extra time per policy, as a fraction of the block's forward: full and offload recompute
# the whole forward; selective recomputes its cheap ops, taken as at least a tenth of it;
# selective-half also reruns every second projection, taken as at least a quarter of it.
RECOMPUTE_FLOOR = {"full": 1.0, "offload": 1.0, "selective": 0.1, "selective-half": 0.25}


@dataclass(frozen=True)
class Candidate:
    """One point of the search: sizes, a policy per block, and the model's peak and time."""

    micro_batch_sizes: Sequence[int]  # a WindowSizes from the search
    block_policies: tuple[tuple[str, str], ...]
    peak_bytes: int
    seconds_per_step: float
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batch_sizes[0]

    @property
    def steps(self) -> int:
        return len(self.micro_batch_sizes)


class Model:
    """The peak and time model of one profile; builds solver chains and prices their solutions."""

    def __init__(
        self,
        profile: Profile,
        *,
        correction_bytes: int = 0,
        safety_margin: float = SAFETY_MARGIN,
        bytes_per_sample: int = 0,
    ) -> None:
        self.profile = profile
        self.correction_bytes = correction_bytes
        self.safety_margin = safety_margin
        self.bytes_per_sample = bytes_per_sample
        # Chains and base times by sizes: pricing a frontier's points reuses its size's.
        self._kept: dict[tuple[object, ...], Any] = {}

    def _memo(self, key: tuple[object, ...], build: Callable[[], Any]) -> Any:
        if key not in self._kept:
            if len(self._kept) >= MEMO_ENTRIES:
                self._kept.clear()
            self._kept[key] = build()
        return self._kept[key]

    def batch_bytes(self, sizes: Sequence[int]) -> int:
        """The largest micro-batch and the loop: the profile's fit, at least the batch's own tensors.

        Beyond the profiled sizes the floor keeps a fit measured on a few small micro-batches (which
        may be views of data already held, so cost nothing) from predicting that a huge micro-batch
        costs nothing; within them the measurement stands.
        """
        b = largest(sizes)
        fitted = math.ceil(self.profile.base_bytes(b))
        if b <= max(self.profile.micro_batch_sizes, default=0):
            return fitted
        return max(fitted, b * self.bytes_per_sample)

    def _gradient_terms(self, steps: int) -> list[int]:
        segments = self.profile.segments
        if self.profile.gradients_held:
            return [0] * len(segments)  # under every micro-batch: in fixed_bytes, like the parameters
        if steps >= 2:
            return [self.profile.gradient_bytes] * len(segments)
        # G_k = gradients of the segments after k: their backwards, which ran before k's, created them.
        # Segment k's own new gradients are inside its measured peak already: the profiled runs
        # hold all gradients, so each backward made its new gradient as a temporary before adding it.
        terms, running = [0] * len(segments), 0
        for k in range(len(segments) - 1, -1, -1):
            terms[k] = running
            running += segments[k].gradient_bytes
        return terms

    def chain(self, sizes: Sequence[int], *, phase: str = STEADY) -> list[solve.Segment]:
        """Solver segments for a window of micro-batches of ``sizes``: memory per phase, time summed.

        ``phase``: STEADY, a micro-batch after the window's first (all gradients live, checkpoints
        in their steady state); FIRST, the window's first micro-batch (its gradients appear as its
        backward runs) with checkpoints on their first call; BOTH, each option at the larger of the
        two, a chain whose peak bounds both phases. The chain is kept: the caller must not change it.
        """
        chain: list[solve.Segment] = self._memo(
            (phase, *_sizes_key(sizes)), lambda: self._build_chain(sizes, phase)
        )
        return chain

    def _build_chain(self, sizes: Sequence[int], phase: str) -> list[solve.Segment]:
        # The first phase is the window's first micro-batch; the steady phase the largest later one
        # (with one micro-batch per window, every window's only one: the same size).
        counts = size_counts(sizes)
        first_size = sizes[0]
        # The largest after the first: all sizes but one copy of the first.
        later = [size for size, count in counts if count > (size == first_size)]
        steady_size = max(later, default=first_size)
        steady_gradients = self._gradient_terms(len(sizes))
        first_gradients = self._gradient_terms(1)
        chain = []
        for k, segment in enumerate(self.profile.segments):
            base = segment.costs[NONE]
            base_seconds = sum(n * base.seconds(m) for m, n in counts)
            forward_seconds = sum(n * base.forward_seconds(m) for m, n in counts)
            options = []
            for policy, cost in segment.costs.items():
                extra = 0.0
                if policy != NONE:
                    # A recompute repeats (part of) the forward: a smaller measured cost is noise.
                    floor = RECOMPUTE_FLOOR.get(policy, 1.0) * forward_seconds
                    extra = max(floor, sum(n * cost.seconds(m) for m, n in counts) - base_seconds)
                steady = (cost.kept(steady_size), cost.peak(steady_size) + steady_gradients[k])
                first = (
                    cost.kept(first_size, first=True),
                    cost.peak(first_size, first=True) + first_gradients[k],
                )
                if phase == STEADY:
                    kept, peak = steady
                elif phase == FIRST:
                    kept, peak = first
                else:
                    kept, peak = max(steady[0], first[0]), max(steady[1], first[1])
                options.append(
                    solve.Option(
                        policy=policy,
                        kept_bytes=math.ceil(kept),
                        peak_bytes=math.ceil(peak),
                        extra_seconds=extra,
                    )
                )
            chain.append(solve.Segment(name=segment.name, options=tuple(options)))
        return chain

    def base_seconds(self, sizes: Sequence[int]) -> float:
        """Seconds per step with no block checkpointed (kept per sizes, like the chains)."""
        seconds: float = self._memo(("base", *_sizes_key(sizes)), lambda: self._sum_base_seconds(sizes))
        return seconds

    def _sum_base_seconds(self, sizes: Sequence[int]) -> float:
        total = self.profile.step_seconds
        for m, n in size_counts(sizes):
            total += n * self.profile.loop_seconds(m)
            total += n * sum(segment.costs[NONE].seconds(m) for segment in self.profile.segments)
        return total

    def fixed_bytes(self, sizes: Sequence[int]) -> int:
        """Bytes live under the activations: parameters, optimizer state, the batches, the correction
        (and the gradients when the profile holds them between windows)."""
        profile = self.profile
        return (
            profile.parameter_bytes
            + (profile.gradient_bytes if profile.gradients_held else 0)
            + profile.optimizer_bytes
            + self.batch_bytes(sizes)
            + profile.slack_bytes
            + profile.reserved_overhead(max(sizes))
            + self.correction_bytes
        )

    def step_bytes(self, sizes: Sequence[int]) -> int:
        """Peak of the optimizer step: static memory, the batch, and the step's own temporaries."""
        profile = self.profile
        return (
            profile.static_bytes
            + self.batch_bytes(sizes)
            + profile.step_peak_bytes
            + profile.slack_bytes
            + profile.reserved_overhead(max(sizes))  # the micro-batches' cached segments (CUDA)
            + self.correction_bytes
        )

    def activation_bytes(self, chain_peak_bytes: int) -> int:
        """The chain's peak (activations and the gradients live with them) with the safety margin."""
        return math.ceil(chain_peak_bytes * (1 + self.safety_margin))

    def room(self, sizes: Sequence[int], capacity_bytes: float) -> float:
        """The largest chain peak whose plan stays within ``capacity_bytes``."""
        room = (capacity_bytes - self.fixed_bytes(sizes)) / (1 + self.safety_margin)
        return math.floor(room) if math.isfinite(room) else room

    def price(self, sizes: Sequence[int], choice: Sequence[int]) -> Candidate:
        """A choice of one option per segment (indices as in ``chain``) with its peak and time."""
        profile = self.profile
        steady = solve.evaluate(self.chain(sizes, phase=STEADY), choice)
        first = solve.evaluate(self.chain(sizes, phase=FIRST), choice)
        chain_peak = max(steady.peak_bytes, first.peak_bytes)
        fixed = self.fixed_bytes(sizes)
        chain_bytes = self.activation_bytes(chain_peak)
        parts = {**profile.static_parts(), "batch and loop": self.batch_bytes(sizes)}
        if fixed + chain_bytes >= self.step_bytes(sizes):
            # The gradients named are those live at the chain's peak (in a window's first
            # micro-batch, at the top of its backward, none may be yet), not all of them.
            parts[profile.gradient_name] = self._gradients_at_peak(sizes, choice, len(sizes))
            margin = chain_bytes - chain_peak
            # The chain's peak holds the gradients that are live then; the rest of it is activations.
            # (fixed holds the slack and the correction too: they are parts of their own below)
            outside = sum(parts.values()) + profile.slack_bytes + self.correction_bytes
            outside += profile.reserved_overhead(max(sizes))
            parts["activations"] = fixed + chain_bytes - margin - outside
            if margin:
                parts[f"safety margin ({self.safety_margin:.0%})"] = margin
        else:
            parts[profile.step_peak_name] = profile.step_peak_bytes
        if profile.slack_bytes:
            parts["slack"] = profile.slack_bytes
        if profile.reserved_overhead(max(sizes)):
            parts["caching allocator (reserved - live)"] = profile.reserved_overhead(max(sizes))
        if self.correction_bytes:
            parts["correction from trials"] = self.correction_bytes
        policies = tuple(
            (segment.name, segment.policies[index])
            for segment, index in zip(profile.segments, choice, strict=True)
            if segment.is_block
        )
        return Candidate(
            micro_batch_sizes=sizes if isinstance(sizes, WindowSizes) else tuple(sizes),
            block_policies=policies,
            peak_bytes=max(fixed + chain_bytes, self.step_bytes(sizes)),
            seconds_per_step=self.base_seconds(sizes) + steady.extra_seconds,
            parts=tuple(parts.items()),
        )

    def _gradients_at_peak(self, sizes: Sequence[int], choice: Sequence[int], steps: int) -> int:
        """The gradient bytes live where the chain peaks: G_k of the segment and phase that set it."""
        if self.profile.gradients_held:
            return self.profile.gradient_bytes  # in fixed_bytes, under every micro-batch
        best = (-1.0, 0)
        for phase, window_steps in ((STEADY, steps), (FIRST, 1)):
            terms = self._gradient_terms(window_steps)
            chain = self.chain(sizes, phase=phase)
            options = [segment.options[index] for segment, index in zip(chain, choice, strict=True)]
            kept = 0
            for option, gradients in zip(options, terms, strict=True):
                # The chain's own sum (costs.chain_peak): the first segment to reach the peak sets it.
                best = max(best, (float(kept + option.peak_bytes), gradients), key=lambda pair: pair[0])
                kept += option.kept_bytes
        return best[1]

    def evaluate(self, sizes: Sequence[int], policies: dict[str, str]) -> Candidate:
        """The model's peak and time for given sizes and block policies (blocks not named: none)."""
        choice = []
        for segment in self.profile.segments:
            wanted = policies.get(segment.name, NONE)
            choice.append(segment.policies.index(wanted) if wanted in segment.policies else 0)
        return self.price(sizes, choice)


def _sizes_key(sizes: Sequence[int]) -> tuple[object, ...]:
    """What a window's chains and times depend on: its first size, its length, its size counts."""
    return (sizes[0], len(sizes), tuple(sorted(size_counts(sizes))))


def largest(sizes: Sequence[int]) -> int:
    return max(size for size, _ in size_counts(sizes))
