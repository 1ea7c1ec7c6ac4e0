"""A saved plan checked before it is used: read within bounds, every field's type and range, the invariants.

A plan file may have been edited by hand, cut short, or be something else entirely (a FIFO, a
huge file, another program's JSON). ``read_plan_file`` reads a regular file of at most
``MAX_PLAN_BYTES`` without blocking; ``check_plan_data`` refuses, naming the field, anything
``Plan.from_dict`` could not turn into a plan that trains exactly ``batch_size`` samples:

- sizes are positive integers (not booleans, not 4.7); ``micro_batch_sizes`` sums to
  ``batch_size / world_size``, has ``steps`` entries and its largest is ``micro_batch_size``;
- policies are known (none, full, selective, offload); shard and source are known;
- byte figures are finite non-negative integers; times are finite and non-negative;
- a pipeline plan names S - 1 distinct stage starts, S stage peaks, a known schedule and at most
  ``steps`` micro-batches per pipeline step.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from typing import Any

import torch

from ...checkpointing.api import POLICIES
from ...errors import ConfigError
from .applying import GRADIENT_SYNCS, STEP_IMPLEMENTATIONS

MAX_PLAN_BYTES = 16 * 1024 * 1024  # a plan with a frontier of 50,000 points is about 13 MiB
KNOWN_POLICIES = frozenset({"none", *POLICIES})
SHARDS = frozenset({"none", "ddp", "fsdp"})
SOURCES = frozenset({"planner", "manual"})
_FIX = "fix the field or make a new plan (mb.plan, or microbatch plan ... --out plan.json)"


def read_plan_file(path: str) -> bytes:
    """The bytes of the plan file at ``path``; ConfigError unless a regular file of at most MAX_PLAN_BYTES.

    Opened with O_NONBLOCK, so a FIFO with no writer is refused instead of waiting for one.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise ConfigError(f"cannot be read: {error.strerror or error}") from error
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError("is not a regular file (a plan is a JSON file: plan.save(path))")
        if info.st_size > MAX_PLAN_BYTES:
            raise ConfigError(
                f"is {info.st_size:,} bytes, more than a plan's limit of {MAX_PLAN_BYTES:,}; "
                "make a new plan (its frontier is kept small)"
            )
        with os.fdopen(descriptor, "rb") as file:
            descriptor = -1
            data = file.read(MAX_PLAN_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot be read: {error.strerror or error}") from error
    finally:
        if descriptor >= 0:
            os.close(descriptor)
    if len(data) > MAX_PLAN_BYTES:  # grew while being read
        raise ConfigError(f"is more than a plan's limit of {MAX_PLAN_BYTES:,} bytes")
    return data


def _refuse(field: str, value: Any, wanted: str) -> ConfigError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ConfigError(f"is not a microbatch plan: field {field} is {shown}, {wanted}; {_FIX}")


def whole(data: Mapping[str, Any], field: str, *, minimum: int) -> int:
    """``data[field]`` as an int >= ``minimum`` (an integral float such as 8.0 is accepted)."""
    return whole_value(data.get(field), field, minimum=minimum)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def whole_value(value: Any, field: str, *, minimum: int) -> int:
    """``value`` (of ``field``) as an int >= ``minimum``; ConfigError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(field, value, f"not an integer >= {minimum}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise _refuse(field, value, f"not an integer >= {minimum}")
    if value < minimum:
        raise _refuse(field, value, f"not an integer >= {minimum}")
    return int(value)


def _seconds(data: Mapping[str, Any], field: str) -> None:
    value = data.get(field, 0.0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise _refuse(field, value, "not a finite number of seconds >= 0")


def _policies(value: Any, field: str) -> None:
    if not isinstance(value, dict):
        raise _refuse(field, value, "not an object of block name -> policy")
    for name, policy in value.items():
        if policy not in KNOWN_POLICIES:
            raise _refuse(f"{field}[{name!r}]", policy, f"not a policy ({', '.join(sorted(KNOWN_POLICIES))})")


def _byte_table(data: Mapping[str, Any], field: str) -> None:
    table = data.get(field, {})
    if not isinstance(table, dict):
        raise _refuse(field, table, "not an object of name -> bytes")
    for name in table:
        _non_negative_number(table, name, f"{field}[{name!r}]")


def _non_negative_number(table: Mapping[str, Any], key: str, field: str) -> None:
    value = table[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise _refuse(field, value, "not a finite number of bytes >= 0")


def _sizes(data: Mapping[str, Any]) -> None:
    """The split's invariants: a rank's batch cut into ``steps`` micro-batches, the largest the size."""
    batch = whole(data, "batch_size", minimum=1)
    world = whole(data, "world_size", minimum=1)
    size = whole(data, "micro_batch_size", minimum=1)
    steps = whole(data, "steps", minimum=1)
    if batch % world:
        raise _refuse("batch_size", batch, f"not divisible by world_size {world}")
    sizes = data.get("micro_batch_sizes")
    if not isinstance(sizes, list) or not sizes:
        raise _refuse("micro_batch_sizes", sizes, "not a list of micro-batch sizes")
    values = [whole_value(item, f"micro_batch_sizes[{index}]", minimum=1) for index, item in enumerate(sizes)]
    if len(values) != steps:
        raise _refuse("steps", steps, f"not the {len(values)} entries of micro_batch_sizes")
    if sum(values) != batch // world:
        raise _refuse(
            "micro_batch_sizes", sizes, f"summing to {sum(values)}, not batch_size / world_size = "
            f"{batch // world}"
        )  # fmt: skip
    if max(values) != size:
        raise _refuse("micro_batch_size", size, f"not the largest of micro_batch_sizes ({max(values)})")


def _frontier(data: Mapping[str, Any]) -> None:
    frontier = data.get("frontier", [])
    if not isinstance(frontier, list):
        raise _refuse("frontier", frontier, "not a list of frontier points")
    for index, point in enumerate(frontier):
        field = f"frontier[{index}]"
        if not isinstance(point, dict):
            raise _refuse(field, point, "not a frontier point (an object)")
        for name in ("micro_batch_size", "steps"):
            whole({f"{field}.{name}": point.get(name)}, f"{field}.{name}", minimum=1)
        whole(
            {f"{field}.predicted_peak_bytes": point.get("predicted_peak_bytes")},
            f"{field}.predicted_peak_bytes",
            minimum=0,
        )
        _seconds({f"{field}.seconds_per_step": point.get("seconds_per_step")}, f"{field}.seconds_per_step")
        _policies(point.get("policies"), f"{field}.policies")


def _labels(data: Mapping[str, Any]) -> None:
    for field, known in (("shard", SHARDS), ("source", SOURCES)):
        if field in data and (not isinstance(data[field], str) or data[field] not in known):
            raise _refuse(field, data[field], f"not one of {', '.join(sorted(known))}")
    for field in ("workload", "device_name"):
        if field in data and not isinstance(data[field], str):
            raise _refuse(field, data[field], "not a string")
    if data.get("device") is not None and not isinstance(data["device"], str):
        raise _refuse("device", data["device"], "not a device type such as 'cpu' or 'cuda'")
    norm = data.get("max_grad_norm")
    if norm is not None and (
        isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm) or norm <= 0
    ):
        raise _refuse("max_grad_norm", norm, "not a finite number > 0 (or null: no clipping)")
    if "simulated" in data and not isinstance(data["simulated"], bool):
        raise _refuse("simulated", data["simulated"], "not true or false")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        raise _refuse("notes", notes, "not a list of strings")


def _memory_options(data: Mapping[str, Any]) -> None:
    """The options ``Plan.apply`` turns into the Accumulator's behaviour (applying.py holds to them)."""
    wide = data.get("accumulate_dtype")
    if wide is not None and not (
        isinstance(wide, str)
        and isinstance(getattr(torch, wide, None), torch.dtype)
        and getattr(torch, wide).is_floating_point
    ):
        raise _refuse("accumulate_dtype", wide, "not a floating dtype name such as 'float32' (or null)")
    if "scaler" in data and not isinstance(data["scaler"], bool):
        raise _refuse("scaler", data["scaler"], "not true or false")
    if "gradient_sync" in data and data["gradient_sync"] not in GRADIENT_SYNCS:
        raise _refuse("gradient_sync", data["gradient_sync"], f"not one of {', '.join(GRADIENT_SYNCS)}")
    tokens = data.get("head_chunk_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise _refuse("head_chunk_tokens", tokens, "not a positive number of tokens (or null: no chunks)")
    step = data.get("optimizer_step")
    if step is not None and step not in STEP_IMPLEMENTATIONS:
        raise _refuse("optimizer_step", step, f"not one of {', '.join(STEP_IMPLEMENTATIONS)} (or null)")


PIPELINE_SCHEDULES = frozenset({"gpipe", "1f1b", "interleaved-1f1b"})


def _byte_list(data: Mapping[str, Any], field: str, count: int) -> None:
    values = data.get(field, [])
    if not isinstance(values, list) or len(values) not in (0, count):
        raise _refuse(field, values, f"not a list of {count} byte counts (one per stage) or empty")
    for index, value in enumerate(values):
        whole_value(value, f"{field}[{index}]", minimum=0)


def _pipeline(data: Mapping[str, Any]) -> None:
    """A pipeline plan's fields agree: S - 1 distinct cuts, S stage peaks, m within the window."""
    stages = whole(data, "pipeline_stages", minimum=1) if "pipeline_stages" in data else 1
    starts = data.get("stage_starts", [])
    if not isinstance(starts, list) or not all(isinstance(name, str) and name for name in starts):
        raise _refuse("stage_starts", starts, "not a list of block names")
    for field in ("stage_peak_bytes", "measured_stage_peak_bytes"):
        _byte_list(data, field, stages)
    bubble = data.get("bubble_fraction", 0.0)
    if isinstance(bubble, bool) or not isinstance(bubble, (int, float)) or not 0 <= bubble < 1:
        raise _refuse("bubble_fraction", bubble, "not a fraction in [0, 1)")
    if stages == 1:
        for field, empty in (("stage_starts", []), ("pipeline_schedule", ""), ("pipeline_micro_batches", 0)):
            if data.get(field, empty) != empty:
                raise _refuse(field, data[field], "set while pipeline_stages is 1 (no pipeline)")
        return
    if len(starts) not in (0, stages - 1) or len(set(starts)) != len(starts):
        raise _refuse(
            "stage_starts", starts, f"not {stages - 1} distinct block names for {stages} stages, nor []"
        )
    schedule = data.get("pipeline_schedule")
    if not isinstance(schedule, str) or schedule not in PIPELINE_SCHEDULES:
        raise _refuse("pipeline_schedule", schedule, f"not one of {', '.join(sorted(PIPELINE_SCHEDULES))}")
    micro_batches = whole(data, "pipeline_micro_batches", minimum=1)
    if micro_batches > whole(data, "steps", minimum=1):
        raise _refuse("pipeline_micro_batches", micro_batches, "more than the window's micro-batches (steps)")


def check_plan_data(data: Any) -> None:
    """Raise ConfigError naming the first field of ``data`` (Plan.to_dict's form) that is wrong."""
    if not isinstance(data, dict):
        raise ConfigError(f"is a JSON {type(data).__name__}, not a microbatch plan (a JSON object); {_FIX}")
    if not isinstance(data.get("workload"), str):
        raise _refuse("workload", data.get("workload"), "not a string (is this a microbatch plan?)")
    _sizes(data)
    _policies(data.get("policies"), "policies")
    for field in ("budget_bytes", "predicted_peak_bytes", "minimum_bytes", "trials"):
        if field in data or field in ("budget_bytes", "predicted_peak_bytes"):
            whole(data, field, minimum=0)
    for field in ("measured_peak_bytes", "cuda_max_allocated_bytes", "parameters", "max_tokens"):
        if data.get(field) is not None:
            whole(data, field, minimum=1 if field == "max_tokens" else 0)
    for field in ("predicted_seconds_per_step", "planning_seconds"):
        _seconds(data, field)
    for field in ("peak_parts", "rank_parts", "estimates"):
        _byte_table(data, field)
    _frontier(data)
    _labels(data)
    _memory_options(data)
    _pipeline(data)
