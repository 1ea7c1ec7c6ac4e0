"""The peak and time model of a plan, and the search over micro-batch sizes.

A plan runs a rank's share of the batch, B_rank = B / W samples, as N micro-batches of sizes
micro_batch_sizes(B_rank, b) = [b] * (N - 1) + [r] with N = ceil(B_rank / b) and 0 < r <= b, so the
effective batch is exactly B. With the profile's fits, for a choice o (one policy per block):

    seconds_per_step = sum over micro-batches m of (loop(m) + sum_k seconds_k(o_k, m)) + step
    peak_bytes       = max(parameters + optimizer state + base(b) + (1 + margin) * chain peak,
                           static + base(b) + step_peak) + slack + correction
    chain peak       = max_k (P_{k-1} + peak_k(o_k, b) + G_k)

(solve.py defines P_k and the activation term). G_k is the gradient memory live while segment k
runs: all gradients when N >= 2 (the earlier micro-batches created them); with N = 1 only those
of segment k and the segments after it (backward creates them in reverse order).

For a fixed b the policy choice is solve.solve on that chain. Only the smallest b for each N is
searched: with time linear in b, N micro-batches cost N * a + k * B_rank whatever their split, and
the smallest b needs the least memory; every other b is dominated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..batching import micro_batch_sizes
from ..profile import NONE, Profile
from . import solve

FRONTIER_POINTS = 256  # per micro-batch size
# Added to the chain's peak: the loop's few scalars from earlier micro-batches, and the fits'
# error beyond the profiled sizes, stay under it.
SAFETY_MARGIN = 0.01
# Least extra time per policy, as a fraction of the block's forward: full and offload recompute
# the whole forward; selective recomputes its cheap ops, taken as at least a tenth of it.
RECOMPUTE_FLOOR = {"full": 1.0, "offload": 1.0, "selective": 0.1}


@dataclass(frozen=True)
class Candidate:
    """One point of the search: sizes, a policy per block, and the model's peak and time."""

    micro_batch_sizes: tuple[int, ...]
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


@dataclass(frozen=True)
class SearchResult:
    best: Candidate | None  # fastest candidate within the capacity; None when nothing fits
    frontier: tuple[Candidate, ...]  # Pareto-optimal in (peak, seconds), fastest first
    minimum: Candidate  # the lowest peak any candidate reaches
    candidates: tuple[Candidate, ...] = field(default=(), repr=False)  # best per micro-batch size


def candidate_sizes(per_rank_batch: int) -> list[int]:
    """b = ceil(B_rank / N) for N = 1 .. B_rank, largest first (about 2 sqrt(B_rank) values)."""
    return sorted({-(-per_rank_batch // steps) for steps in range(1, per_rank_batch + 1)}, reverse=True)


class Model:
    """The peak and time model of one profile for one per-rank batch; builds solver chains."""

    def __init__(
        self,
        profile: Profile,
        *,
        per_rank_batch: int,
        correction_bytes: int = 0,
        safety_margin: float = SAFETY_MARGIN,
    ) -> None:
        self.profile = profile
        self.per_rank_batch = per_rank_batch
        self.correction_bytes = correction_bytes
        self.safety_margin = safety_margin

    def _gradient_terms(self, steps: int) -> list[int]:
        segments = self.profile.segments
        if steps >= 2:
            return [self.profile.gradient_bytes] * len(segments)
        # G_k = gradients of segments k..end: backward has created those by the end of segment k.
        terms, running = [0] * len(segments), 0
        for k in range(len(segments) - 1, -1, -1):
            running += segments[k].gradient_bytes
            terms[k] = running
        return terms

    def chain(self, sizes: Sequence[int]) -> list[solve.Segment]:
        """Solver segments for micro-batches of ``sizes``: memory at the largest, time summed."""
        b = max(sizes)
        gradients = self._gradient_terms(len(sizes))
        chain = []
        for segment, gradient_bytes in zip(self.profile.segments, gradients, strict=True):
            base = segment.costs[NONE] if NONE in segment.costs else next(iter(segment.costs.values()))
            base_seconds = sum(base.seconds(m) for m in sizes)
            forward_seconds = sum(base.forward_seconds(m) for m in sizes)
            options = []
            for policy, cost in segment.costs.items():
                extra = 0.0
                if policy != NONE:
                    # A recompute repeats (part of) the forward: a smaller measured cost is noise.
                    floor = RECOMPUTE_FLOOR.get(policy, 1.0) * forward_seconds
                    extra = max(floor, sum(cost.seconds(m) for m in sizes) - base_seconds)
                options.append(
                    solve.Option(
                        policy=policy,
                        kept_bytes=math.ceil(cost.kept_bytes(b)),
                        peak_bytes=math.ceil(cost.peak_bytes(b)) + gradient_bytes,
                        extra_seconds=extra,
                    )
                )
            chain.append(solve.Segment(name=segment.name, options=tuple(options)))
        return chain

    def base_seconds(self, sizes: Sequence[int]) -> float:
        """Seconds per step with no block checkpointed."""
        total = self.profile.step_seconds
        for m in sizes:
            total += self.profile.loop_seconds(m)
            for segment in self.profile.segments:
                cost = segment.costs[NONE] if NONE in segment.costs else next(iter(segment.costs.values()))
                total += cost.seconds(m)
        return total

    def fixed_bytes(self, sizes: Sequence[int]) -> int:
        """Bytes live under the activations: parameters, optimizer state, the batches, the correction."""
        profile = self.profile
        return (
            profile.parameter_bytes
            + profile.optimizer_bytes
            + math.ceil(profile.base_bytes(max(sizes)))
            + profile.slack_bytes
            + self.correction_bytes
        )

    def step_bytes(self, sizes: Sequence[int]) -> int:
        """Peak of the optimizer step: static memory, the batch, and the step's own temporaries."""
        profile = self.profile
        return (
            profile.static_bytes
            + math.ceil(profile.base_bytes(max(sizes)))
            + profile.step_peak_bytes
            + profile.slack_bytes
            + self.correction_bytes
        )

    def activation_bytes(self, solution_peak_bytes: int) -> int:
        """The chain's peak (activations and the gradients live with them) with the safety margin."""
        return math.ceil(solution_peak_bytes * (1 + self.safety_margin))

    def room(self, sizes: Sequence[int], capacity_bytes: float) -> float:
        """The largest chain peak whose plan stays within ``capacity_bytes``."""
        room = (capacity_bytes - self.fixed_bytes(sizes)) / (1 + self.safety_margin)
        return math.floor(room) if math.isfinite(room) else room

    def candidate(
        self, sizes: Sequence[int], chain: Sequence[solve.Segment], solution: solve.Solution
    ) -> Candidate:
        profile = self.profile
        fixed = self.fixed_bytes(sizes)
        chain_bytes = self.activation_bytes(solution.peak_bytes)
        parts = {**profile.static_parts(), "batch and loop": math.ceil(profile.base_bytes(max(sizes)))}
        if fixed + chain_bytes >= self.step_bytes(sizes):
            margin = chain_bytes - solution.peak_bytes
            # The chain's peak holds the gradients that are live then; the rest of it is activations.
            parts["activations"] = fixed + chain_bytes - margin - sum(parts.values())
            if margin:
                parts[f"safety margin ({self.safety_margin:.0%})"] = margin
        else:
            parts["optimizer step temporaries"] = profile.step_peak_bytes
        if profile.slack_bytes:
            parts["slack"] = profile.slack_bytes
        if self.correction_bytes:
            parts["correction from trials"] = self.correction_bytes
        blocks = {segment.name for segment in profile.segments if segment.is_block}
        policies = tuple(
            (name, policy) for name, policy in solution.policies(chain).items() if name in blocks
        )
        return Candidate(
            micro_batch_sizes=tuple(sizes),
            block_policies=policies,
            peak_bytes=max(fixed + chain_bytes, self.step_bytes(sizes)),
            seconds_per_step=self.base_seconds(sizes) + solution.extra_seconds,
            parts=tuple(parts.items()),
        )

    def evaluate(self, sizes: Sequence[int], policies: dict[str, str]) -> Candidate:
        """The model's peak and time for given sizes and block policies (blocks not named: none)."""
        chain = self.chain(sizes)
        choice = []
        for segment in chain:
            wanted = policies.get(segment.name, NONE)
            names = [option.policy for option in segment.options]
            choice.append(names.index(wanted) if wanted in names else 0)
        return self.candidate(sizes, chain, solve.evaluate(chain, choice))


def pareto(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates not dominated in (peak_bytes, seconds_per_step), fastest first."""
    ordered = sorted(candidates, key=lambda c: (c.seconds_per_step, c.peak_bytes, -c.micro_batch_size))
    front: list[Candidate] = []
    for candidate in ordered:
        if not front or candidate.peak_bytes < front[-1].peak_bytes:
            front.append(candidate)
    return front


def search(
    profile: Profile,
    *,
    per_rank_batch: int,
    capacity_bytes: float,
    correction_bytes: int = 0,
    safety_margin: float = SAFETY_MARGIN,
) -> SearchResult:
    """The fastest plan whose predicted peak is <= capacity_bytes, the frontier, and the minimum."""
    model = Model(
        profile, per_rank_batch=per_rank_batch, correction_bytes=correction_bytes, safety_margin=safety_margin
    )
    best: Candidate | None = None
    points: list[Candidate] = []
    per_size: list[Candidate] = []
    minimum: Candidate | None = None
    for b in candidate_sizes(per_rank_batch):
        sizes = micro_batch_sizes(per_rank_batch, b)
        chain = model.chain(sizes)
        front = solve.frontier(chain, max_points=FRONTIER_POINTS)
        complete = len(front) < FRONTIER_POINTS
        # The frontier's last point has the lowest peak, unless the frontier was cut short.
        lowest = model.candidate(sizes, chain, front[-1] if complete else solve.minimum_peak(chain))
        if minimum is None or lowest.peak_bytes < minimum.peak_bytes:
            minimum = lowest
        points.extend(model.candidate(sizes, chain, s) for s in front)
        if model.step_bytes(sizes) > capacity_bytes:
            continue
        # Fastest first: the first point within the room is the least time, then the least peak.
        room = model.room(sizes, capacity_bytes)
        solution = next((s for s in front if s.peak_bytes <= room), None)
        if solution is None and not complete:
            solution = solve.solve(chain, room)
        if solution is None:
            continue
        found = model.candidate(sizes, chain, solution)
        per_size.append(found)
        if best is None or (found.seconds_per_step, found.peak_bytes) < (
            best.seconds_per_step,
            best.peak_bytes,
        ):
            best = found
    if minimum is None:  # candidate_sizes is never empty for per_rank_batch >= 1
        raise ValueError("search: per_rank_batch must be >= 1")
    return SearchResult(
        best=best, frontier=tuple(pareto(points)), minimum=minimum, candidates=tuple(per_size)
    )
