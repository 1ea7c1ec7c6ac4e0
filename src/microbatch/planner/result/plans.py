"""The planner's result: ``Plan``, its alternatives (``FrontierPoint``), and ``Plan.apply``.

There is one plan type for the library, the CLI and ``microbatch train``. The planner makes it
(``mb.plan``); a user who knows the micro-batch size makes it with ``Plan.manual``; a saved one
comes back with ``Plan.load`` (the JSON of ``plan.save``, also each run folder's plan.json).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ...accumulate.accumulator import Accumulator
from ...checkpointing.api import CheckpointHandle, checkpoint
from ...distributed.pipeline import Pipeline
from ...errors import ConfigError
from ...memory import format_bytes
from ...trees.batches import micro_batch_sizes, split_batch
from ...trees.modules import unwrap_compiled
from ..search.splits import describe_split
from . import applying
from .applying import inner_model
from .checks import check_plan_data, read_plan_file
from .pipeline_build import build_pipeline
from .plan_file import check_checksum, sealed_json, write_plan_file
from .text import NONE, plan_text, summarize_policies

# The attribute of a model that a plan's apply() marks (holding the checkpoint handle, or None).


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
    parameters: int | None = None  # the model's parameter count, checked when a plan is reused
    device: str | None = None  # the device type it was made for ("cuda", "cpu", ...)
    source: str = "planner"  # "planner", or "manual" (Plan.manual)
    simulated: bool = False  # predicted under fake tensors for device_name; no trial ran
    device_name: str = ""
    shard: str = "none"  # data parallelism across world_size ranks: none, ddp or fsdp
    rank_parts: tuple[tuple[str, int], ...] = ()  # one rank's peak by part, data-parallel extras named
    estimates: tuple[tuple[str, int], ...] = ()  # microbatch's figures beside accelerate's and the formula
    # Memory-changing options the plan was made (profiled, tried) with; apply holds to them (applying.py).
    accumulate_dtype: str | None = None  # e.g. "float32": low-precision gradients summed wide
    scaler: bool = False  # a GradScaler steps the window
    gradient_sync: str = "window"  # FSDP2: reduce-scatter once per "window" or every "micro-batch"
    # A pipeline (plan(..., pipeline=S)): world_size counts the data-parallel replicas, each of
    # pipeline_stages ranks; a window's micro-batches run pipeline_micro_batches per pipeline step.
    pipeline_stages: int = 1
    pipeline_schedule: str = ""  # "1f1b" or "gpipe"; "" without a pipeline
    pipeline_micro_batches: int = 0  # the schedule's m; ceil(steps / m) pipeline steps per window
    stage_starts: tuple[str, ...] = ()  # the blocks where stages 1 .. S-1 begin
    stage_peak_bytes: tuple[int, ...] = ()  # predicted peak of each stage's ranks
    measured_stage_peak_bytes: tuple[int, ...] = ()  # the trial on the ranks: each stage's worst rank
    bubble_fraction: float = 0.0  # (S - 1) / (m + S - 1): the share of a pipeline step spent idle
    max_grad_norm: float | None = None  # gradients clipped to this total norm once per window
    # Exact levers (planner/levers/): the loss head computed this many tokens at a time (its logits
    # recomputed in backward), and the optimizer step's implementation when not the optimizer's own.
    head_chunk_tokens: int | None = None
    optimizer_step: str | None = None

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
        modules = dict(unwrap_compiled(model).named_modules())  # a compiled model: the names inside
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

        ``model``: the model, or its DDP / FSDP2 / torch.compile wrapper (the blocks are checkpointed in
        the module inside; the Accumulator gets the wrapper, for its gradient sync). ``accumulator_options``
        go to Accumulator (scheduler, max_grad_norm, scaler, ...); the options that change memory
        (accumulate_dtype, scaler, the FSDP sync mode, max_grad_norm) must be those the plan was made with
        (planner/result/applying.py) and default to them. Feed it micro-batches of ``micro_batch_sizes``
        (``plan.split(batch)`` cuts a rank's batch): it warns once when a full window holds another
        number of samples than the plan's per-rank batch. The plan's loss head chunks and optimizer
        step implementation are installed too. ``plan.remove(model)`` undoes both;
        applying a plan to a model that already has one applied raises ConfigError (remove it first).
        """
        if self.pipeline_stages > 1:
            raise ConfigError(
                f"this plan cuts the model into {self.pipeline_stages} pipeline stages; build its pipeline "
                "with plan.pipeline(model, example=..., loss_fn=...) on every rank instead of plan.apply"
            )
        self.check_model(model)  # the blocks and parameter count the plan's memory promise is for
        options = dict(accumulator_options)
        if self.source != "manual":  # a manual plan measured nothing: the user vouches for every option
            options = applying.accumulator_options(
                accumulate_dtype=self.accumulate_dtype,
                scaler=self.scaler,
                gradient_sync=self.gradient_sync,
                max_grad_norm=self.max_grad_norm,
                given=options,
            )
        options.setdefault("samples_per_window", sum(self.micro_batch_sizes))
        return applying.attach(
            model,
            self.checkpoint,
            optimizer,
            self.steps,
            options,
            head_chunk_tokens=self.head_chunk_tokens,
            optimizer_step=self.optimizer_step,
        )

    def pipeline(
        self,
        model: nn.Module,
        *,
        example: torch.Tensor,
        loss_fn: Any,
        autocast_dtype: torch.dtype | None = None,
        ignore_index: int = -100,
    ) -> Pipeline:
        """A pipeline plan's ``mb.distributed.Pipeline`` over this launch's ranks (every rank calls it):
        cut at ``stage_starts``, ``pipeline_micro_batches`` per step under ``pipeline_schedule``, each
        stage's blocks checkpointed by the plan's policies (planner/result/pipeline_build.py)."""
        return build_pipeline(
            self,
            model,
            example=example,
            loss_fn=loss_fn,
            autocast_dtype=autocast_dtype,
            ignore_index=ignore_index,
        )

    def remove(self, model: nn.Module) -> None:
        """Undo ``apply``: the model's blocks are plain again and apply's Accumulator is closed (its
        gradient hooks removed). A model with no plan applied is left as is."""
        applying.detach(model)

    def check_model(self, model: nn.Module, *, device: torch.device | str | None = None) -> None:
        """Raise ConfigError unless ``model`` (and ``device``) is what this plan was made for.

        Checked: every block the plan names exists, the parameter count, the device type.
        """
        modules = dict(inner_model(model).named_modules())
        missing = [name for name, _ in self.block_policies if name not in modules]
        count = sum(parameter.numel() for parameter in model.parameters())
        problems = []
        if missing:
            problems.append(f"the model has no block(s) {', '.join(map(repr, missing[:3]))}")
        if self.parameters is not None and count != self.parameters:
            problems.append(f"the model has {count:,} parameters, the plan's model {self.parameters:,}")
        device_type = torch.device(device).type if device is not None else None
        if self.device is not None and device_type is not None and device_type != self.device:
            problems.append(f"the device is {device_type}, the plan was made for {self.device}")
        if problems:
            raise ConfigError(
                f"this plan was made for another model ({self.workload}): {'; '.join(problems)}. "
                "Plan for this model instead (mb.plan, or microbatch plan ... --out plan.json)"
            )

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
            "parameters": self.parameters,
            "device": self.device,
            "source": self.source,
            "simulated": self.simulated,
            "device_name": self.device_name,
            "shard": self.shard,
            "rank_parts": dict(self.rank_parts),
            "accumulate_dtype": self.accumulate_dtype,
            "scaler": self.scaler,
            "gradient_sync": self.gradient_sync,
            "max_grad_norm": self.max_grad_norm,
            "head_chunk_tokens": self.head_chunk_tokens,
            "optimizer_step": self.optimizer_step,
            "estimates": dict(self.estimates),
            "pipeline_stages": self.pipeline_stages,
            "pipeline_schedule": self.pipeline_schedule,
            "pipeline_micro_batches": self.pipeline_micro_batches,
            "stage_starts": list(self.stage_starts),
            "stage_peak_bytes": list(self.stage_peak_bytes),
            "measured_stage_peak_bytes": list(self.measured_stage_peak_bytes),
            "bubble_fraction": self.bubble_fraction,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan ``to_dict`` wrote; ConfigError naming the field that is missing or wrong (plan_checks)."""
        check_plan_data(data)
        try:
            values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            values["micro_batch_sizes"] = tuple(int(size) for size in data["micro_batch_sizes"])
            values["block_policies"] = tuple((str(k), str(v)) for k, v in dict(data["policies"]).items())
            values["peak_parts"] = tuple(
                (str(k), int(v)) for k, v in dict(data.get("peak_parts", {})).items()
            )
            values["frontier"] = tuple(
                FrontierPoint(
                    micro_batch_size=int(point["micro_batch_size"]),
                    steps=int(point["steps"]),
                    block_policies=tuple((str(k), str(v)) for k, v in dict(point["policies"]).items()),
                    predicted_peak_bytes=int(point["predicted_peak_bytes"]),
                    seconds_per_step=float(point["seconds_per_step"]),
                )
                for point in data.get("frontier", [])
            )
            values["notes"] = tuple(str(note) for note in data.get("notes", []))
            for name in ("rank_parts", "estimates"):  # simulated / sharded plans: name -> bytes
                values[name] = tuple((str(k), int(v)) for k, v in dict(data.get(name, {})).items())
            values["stage_starts"] = tuple(str(name) for name in data.get("stage_starts", []))
            for name in ("stage_peak_bytes", "measured_stage_peak_bytes"):
                values[name] = tuple(int(value) for value in data.get(name, []))
            return cls(**values)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigError(
                f"not a microbatch plan ({type(error).__name__}: {error}); write one with plan.save(path) "
                "or microbatch plan ... --out plan.json"
            ) from error

    def to_json(self) -> str:
        """``to_dict()`` as JSON, keys in their own order (the block order is the model's), and the
        checksum Plan.load checks (plan_file.py)."""
        return sealed_json(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (the same as a run folder's plan.json); ``Plan.load`` reads it back.

        Atomic (plan_file.py): a write cut short leaves the old file as it was."""
        write_plan_file(os.fspath(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan saved at ``path``; ConfigError naming the file and the field when it is not a plan.

        The file is read within bounds (plan_checks.read_plan_file: a regular file, at most
        MAX_PLAN_BYTES, never waiting on a FIFO) and checked field by field before it is used.
        """
        try:
            text = read_plan_file(os.fspath(path)).decode("utf-8")
            data = json.loads(text)
            plan = cls.from_dict(data)  # a wrong field is named first; a valid one changed fails the sum
            check_checksum(data)
            return plan
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            if isinstance(error, ConfigError):
                raise ConfigError(f"plan {os.fspath(path)!r} {error}") from error
            what = (
                "nested too deeply"
                if isinstance(error, RecursionError)
                else f"{type(error).__name__}: {error}"
            )
            raise ConfigError(f"plan {os.fspath(path)!r} is not JSON ({what})") from error

    @classmethod
    def manual(
        cls,
        *,
        batch_size: int,
        micro_batch_size: int,
        policies: Mapping[str, str] | None = None,
        world_size: int = 1,
        workload: str = "manual",
        budget_bytes: int = 0,
        parameters: int | None = None,
        device: str | None = None,
    ) -> Plan:
        """A plan the user chose: micro-batches of ``micro_batch_size`` (the last one shorter when it
        does not divide the rank's batch), ``policies`` block name -> policy (default none).

        Nothing is measured or predicted (predicted peak and time are 0, there is no frontier):
        the user vouches that it fits. steps = ceil(batch_size / world_size / micro_batch_size).
        """
        for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if batch_size % world_size:
            raise ConfigError(f"batch_size={batch_size} is not divisible by world_size={world_size}")
        per_rank = batch_size // world_size
        size = min(micro_batch_size, per_rank)
        sizes = tuple(micro_batch_sizes(per_rank, size))
        steps = len(sizes)
        return cls(
            workload=workload,
            batch_size=batch_size,
            world_size=world_size,
            micro_batch_size=size,
            steps=steps,
            micro_batch_sizes=sizes,
            block_policies=tuple((dict(policies) if policies else {}).items()),
            budget_bytes=budget_bytes,
            predicted_peak_bytes=0,
            measured_peak_bytes=None,
            predicted_seconds_per_step=0.0,
            peak_parts=(),
            frontier=(),
            parameters=parameters,
            device=device,
            source="manual",
        )

    def headline(self) -> str:
        """One line: the split, the checkpointing, the predicted (and measured) peak and the budget."""
        split = describe_split(self.micro_batch_sizes)
        ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
        if self.pipeline_stages > 1:
            stages = f"{self.pipeline_stages} stages ({self.pipeline_schedule})"
            ranks = f" x {self.world_size} replica(s) x {stages}"
        head = (
            f"batch {self.batch_size} = micro-batch {split}{ranks}; {summarize_policies(self.block_policies)}"
        )
        if self.source == "manual":
            return f"{head}; manual plan (nothing predicted)"
        measured = ""
        if self.measured_peak_bytes:
            rows = (
                f"{self.micro_batch_size} full-length rows"
                if self.max_tokens
                else f"{self.micro_batch_size} rows"
            )
            measured = (
                f", measured {format_bytes(self.measured_peak_bytes)} in the trial (micro-batches of {rows})"
            )
        return (
            f"{head}; predicted peak {format_bytes(self.predicted_peak_bytes)}{measured} "
            f"of {format_bytes(self.budget_bytes)}"
        )

    def __str__(self) -> str:
        return plan_text(self)
