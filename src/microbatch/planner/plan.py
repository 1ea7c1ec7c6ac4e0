"""The planner's result: ``Plan``, its alternatives (``FrontierPoint``), and ``Plan.apply``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accumulate import Accumulator
from ..batching import split_batch
from ..checkpoint import CheckpointHandle, checkpoint
from ..errors import ConfigError
from ..memory import format_bytes

NONE = "none"


def summarize_policies(block_policies: Sequence[tuple[str, str]]) -> str:
    """'full x3, none x9' (counts in block order of first appearance); 'no blocks' when empty."""
    if not block_policies:
        return "no blocks"
    counts = Counter(policy for _, policy in block_policies)
    return ", ".join(f"{policy} x{count}" for policy, count in counts.items())


@dataclass(frozen=True)
class FrontierPoint:
    """A Pareto-optimal alternative: no other plan is both faster and needs less memory."""

    micro_batch_size: int
    steps: int
    block_policies: tuple[tuple[str, str], ...]
    predicted_peak_bytes: int
    seconds_per_step: float

    @property
    def policies(self) -> dict[str, str]:
        return dict(self.block_policies)

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "steps": self.steps,
            "policies": self.policies,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "seconds_per_step": self.seconds_per_step,
        }

    def __str__(self) -> str:
        return (
            f"micro-batch {self.micro_batch_size} x {self.steps} steps, "
            f"{summarize_policies(self.block_policies)}: {format_bytes(self.predicted_peak_bytes)}, "
            f"{self.seconds_per_step:.3g} s/step"
        )


@dataclass(frozen=True)
class Plan:
    """How to train ``batch_size`` samples per optimizer step within ``budget_bytes`` of peak memory.

    Each of ``world_size`` ranks runs ``steps`` micro-batches of ``micro_batch_sizes`` (all
    ``micro_batch_size`` but a possibly shorter last one) per optimizer step, so the effective batch
    is exactly ``batch_size``. ``block_policies`` says per block: none, full, selective or offload.
    ``measured_peak_bytes`` comes from one real window run under MemoryTracker (None without a trial);
    ``peak_parts`` is what the predicted peak is made of; ``minimum_bytes`` is the least budget any
    plan is predicted to fit (micro-batch 1, the blocks checkpointed). ``max_tokens``: for a workload
    with variable lengths (``Workload.max_length``), the padded-token budget per micro-batch
    (``micro_batch_size x max_length``) for ``split_by_tokens``; None otherwise.
    """

    workload: str
    batch_size: int
    world_size: int
    micro_batch_size: int
    steps: int
    micro_batch_sizes: tuple[int, ...]
    block_policies: tuple[tuple[str, str], ...]
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    predicted_seconds_per_step: float
    peak_parts: tuple[tuple[str, int], ...]
    frontier: tuple[FrontierPoint, ...]
    minimum_bytes: int = 0
    cuda_max_allocated_bytes: int | None = None
    trials: int = 0
    planning_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    max_tokens: int | None = None  # padded tokens per micro-batch, for variable-length workloads
    simulated: bool = False  # predicted under fake tensors for device_name; no trial ran
    device_name: str = ""
    shard: str = "none"  # data parallelism across world_size ranks: none, ddp or fsdp
    rank_parts: tuple[tuple[str, int], ...] = ()  # one rank's peak by part, data-parallel extras named
    estimates: tuple[tuple[str, int], ...] = ()  # microbatch's figures beside accelerate's and the formula

    @property
    def policies(self) -> dict[str, str]:
        """Block name -> policy, every block named."""
        return dict(self.block_policies)

    @property
    def checkpointed_blocks(self) -> list[str]:
        return [name for name, policy in self.block_policies if policy != NONE]

    @property
    def samples_per_second(self) -> float:
        """Predicted: the effective batch over the predicted time of one optimizer step."""
        return (
            self.batch_size / self.predicted_seconds_per_step if self.predicted_seconds_per_step > 0 else 0.0
        )

    # ------------------------------------------------------------------ use
    def checkpoint(self, model: nn.Module) -> CheckpointHandle | None:
        """Checkpoint the plan's blocks of ``model`` in place; None when the plan checkpoints none."""
        if not self.checkpointed_blocks:
            return None
        modules = dict(model.named_modules())
        missing = [name for name, _ in self.block_policies if name not in modules]
        if missing:
            raise ConfigError(
                f"model has no block(s) {', '.join(map(repr, missing[:3]))} from this plan; apply the plan "
                f"to the model it was made for ({self.workload})"
            )
        return checkpoint(model, policy=self.policies)

    def apply(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, **accumulator_options: Any
    ) -> Accumulator:
        """Checkpoint the chosen blocks of ``model`` and return an Accumulator for ``steps`` micro-batches.

        ``accumulator_options`` go to Accumulator (scheduler, max_grad_norm, scaler, ...). Feed it
        micro-batches of ``micro_batch_sizes`` (``plan.split(batch)`` cuts a rank's batch).
        """
        self.checkpoint(model)
        return Accumulator(model, optimizer, steps=self.steps, **accumulator_options)

    def split(self, batch: Any) -> list[Any]:
        """A rank's batch of ``sum(micro_batch_sizes)`` samples cut into the plan's micro-batches."""
        return split_batch(batch, self.micro_batch_sizes)

    # ------------------------------------------------------------------ show
    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "steps": self.steps,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "policies": self.policies,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "minimum_bytes": self.minimum_bytes,
            "cuda_max_allocated_bytes": self.cuda_max_allocated_bytes,
            "predicted_seconds_per_step": self.predicted_seconds_per_step,
            "samples_per_second": self.samples_per_second,
            "peak_parts": dict(self.peak_parts),
            "frontier": [point.to_dict() for point in self.frontier],
            "trials": self.trials,
            "planning_seconds": self.planning_seconds,
            "notes": list(self.notes),
            "max_tokens": self.max_tokens,
            "simulated": self.simulated,
            "device_name": self.device_name,
            "shard": self.shard,
            "rank_parts": dict(self.rank_parts),
            "estimates": dict(self.estimates),
        }

    def __str__(self) -> str:
        sizes = self.micro_batch_sizes
        split = f"{self.micro_batch_size} x {self.steps} steps"
        if len(sizes) > 1 and sizes[-1] != sizes[0]:
            split = f"{self.micro_batch_size} x {self.steps - 1} + {sizes[-1]} (steps={self.steps})"
        ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
        measured = (
            f", measured {format_bytes(self.measured_peak_bytes)}"
            if self.measured_peak_bytes is not None
            else ""
        )
        lines = [
            f"Plan for {self.workload}: batch {self.batch_size} = micro-batch {split}{ranks}",
            f"  budget {format_bytes(self.budget_bytes)}: "
            f"predicted peak {format_bytes(self.predicted_peak_bytes)}{measured}",
            f"  predicted {self.predicted_seconds_per_step:.3g} s per optimizer step, "
            f"{self.samples_per_second:.1f} samples/s",
            *(
                [f"  token budget: max_tokens={self.max_tokens} padded tokens per micro-batch"]
                if self.max_tokens
                else []
            ),
            "  peak = " + " + ".join(f"{name} {format_bytes(v)}" for name, v in self.peak_parts if v),
            "",
            f"  {'block':<28} policy",
        ]
        lines.extend(f"  {name:<28} {policy}" for name, policy in self.block_policies)
        lines.extend(_report_lines(self))
        lines += ["", "Frontier (no alternative is both faster and smaller; * = chosen):"]
        lines.append(f"    {'micro':>6} {'steps':>6}  {'policies':<28} {'peak':>10} {'s/step':>9}")
        for point in self.frontier:
            chosen = (
                point.micro_batch_size == self.micro_batch_size
                and point.block_policies == self.block_policies
            )
            lines.append(
                f"  {'*' if chosen else ' '} {point.micro_batch_size:>6} {point.steps:>6}  "
                f"{summarize_policies(point.block_policies):<28} "
                f"{format_bytes(point.predicted_peak_bytes):>10} {point.seconds_per_step:>9.3g}"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _report_lines(plan: Plan) -> list[str]:
    """A simulated or sharded plan's per-rank breakdown and the estimates beside it."""
    lines: list[str] = []
    if plan.simulated or plan.shard != "none":
        what = "simulated" if plan.simulated else "profiled"
        where = f"{what} on {plan.device_name}, shard {plan.shard}, {plan.world_size} ranks"
        lines += ["", f"Per rank ({where}):"]
        lines.extend(f"  {name:<52} {format_bytes(value):>10}" for name, value in plan.rank_parts if value)
    if plan.estimates:
        lines += ["", f"Beside other estimates (micro-batch {plan.micro_batch_size}, one rank, unsharded):"]
        lines.extend(f"  {name:<52} {format_bytes(value):>10}" for name, value in plan.estimates)
    return lines
