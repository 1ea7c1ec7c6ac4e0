"""Saved plans are checked before use (issue 22): one line naming the file and the field, bounded reads."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import microbatch as mb
from microbatch import cli
from microbatch.errors import ConfigError
from microbatch.planner.result.checks import MAX_PLAN_BYTES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def plan_data() -> dict[str, Any]:
    plan = mb.Plan.manual(batch_size=8, micro_batch_size=3, policies={"blocks.0": "full", "blocks.1": "none"})
    data: dict[str, Any] = plan.to_dict()
    data["frontier"] = [
        {
            "micro_batch_size": 3,
            "steps": 3,
            "policies": plan.policies,
            "predicted_peak_bytes": 10,
            "seconds_per_step": 1.0,
        }
    ]
    return data


@pytest.fixture
def no_hang() -> Iterator[None]:
    def timeout(signum: int, frame: Any) -> None:
        raise TimeoutError("Plan.load blocked")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


EDITS: dict[str, tuple[dict[str, Any], str]] = {
    "sizes sum past the batch": ({"micro_batch_sizes": [3, 3, 3]}, "micro_batch_sizes"),
    "size disagrees with sizes": ({"micro_batch_size": 4}, "micro_batch_size"),
    "fractional sizes": ({"micro_batch_sizes": [4.7, 3.3]}, "micro_batch_sizes[0]"),
    "count is not steps": ({"steps": 2}, "steps"),
    "steps 10^9": ({"steps": 10**9}, "steps"),
    "zero batch": ({"batch_size": 0}, "batch_size"),
    "bool as int": ({"batch_size": True}, "batch_size"),
    "string size": ({"micro_batch_size": "3"}, "micro_batch_size"),
    "negative budget": ({"budget_bytes": -5}, "budget_bytes"),
    "nan budget": ({"budget_bytes": math.nan}, "budget_bytes"),
    "infinite peak": ({"predicted_peak_bytes": math.inf}, "predicted_peak_bytes"),
    "unknown policy": ({"policies": {"blocks.0": "half"}}, "policies['blocks.0']"),
    "world size 3": ({"world_size": 3}, "batch_size"),
    "unknown shard": ({"shard": "tp"}, "shard"),
    "negative seconds": ({"predicted_seconds_per_step": -1.0}, "predicted_seconds_per_step"),
    "frontier point": ({"frontier": [{"micro_batch_size": 0}]}, "frontier[0].micro_batch_size"),
    "frontier policy": (
        {
            "frontier": [
                {
                    "micro_batch_size": 1,
                    "steps": 1,
                    "predicted_peak_bytes": 1,
                    "seconds_per_step": 1.0,
                    "policies": {"a": 1},
                }
            ]
        },
        "frontier[0].policies['a']",
    ),
    "notes not strings": ({"notes": [1]}, "notes"),
    # The options Plan.apply turns into the Accumulator's behaviour (issue 31).
    "accumulate_dtype typo": ({"accumulate_dtype": "bfloat"}, "accumulate_dtype"),
    "accumulate_dtype integer": ({"accumulate_dtype": "int32"}, "accumulate_dtype"),
    "accumulate_dtype number": ({"accumulate_dtype": 32}, "accumulate_dtype"),
    "gradient_sync unknown": ({"gradient_sync": "every-micro-batch"}, "gradient_sync"),
    "scaler as a word": ({"scaler": "no"}, "scaler"),
    "scaler as a number": ({"scaler": 0}, "scaler"),
    "max_grad_norm negative": ({"max_grad_norm": -1.0}, "max_grad_norm"),
    "max_grad_norm string": ({"max_grad_norm": "1.0"}, "max_grad_norm"),
    "simulated as a word": ({"simulated": "yes"}, "simulated"),
    "source unknown": ({"source": "guess"}, "source"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "parameters negative": ({"parameters": -1}, "parameters"),
}

# Fields a plan file carries that are computed from the others, never loaded back.
DERIVED_FIELDS = {"samples_per_second"}


def test_every_field_of_a_saved_plan_is_checked(tmp_path: Path, plan_data: dict[str, Any]) -> None:
    # Any field given a value of no type it can take (a JSON object where a scalar or list belongs,
    # a list where an object belongs) is refused by name: nothing reaches apply unchecked.
    path = tmp_path / "plan.json"
    unchecked = []
    for field, value in plan_data.items():
        if field in DERIVED_FIELDS:
            continue
        wrong: Any = [["not", "a", "table"]] if isinstance(value, dict) else {"not": "a value"}
        path.write_text(json.dumps({**plan_data, field: wrong}))
        try:
            mb.Plan.load(path)
        except ConfigError as error:
            if f"field {field}" not in str(error) and field not in str(error):
                unchecked.append(f"{field}: {error}")
        else:
            unchecked.append(f"{field}: loaded")
    assert not unchecked, unchecked


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_plan_is_refused_naming_the_file_and_field(
    tmp_path: Path, plan_data: dict[str, Any], edit: str
) -> None:
    change, field = EDITS[edit]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan_data, **change}))
    with pytest.raises(ConfigError) as raised:
        mb.Plan.load(path)
    message = str(raised.value)
    assert str(path) in message and f"field {field}" in message, message
    assert "\n" not in message


def test_a_valid_plan_still_loads(tmp_path: Path, plan_data: dict[str, Any]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_data))
    assert mb.Plan.load(path).micro_batch_sizes == (3, 3, 2)


def test_reading_is_bounded(tmp_path: Path, no_hang: None) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        mb.Plan.load(fifo)  # no writer: refused at once, not waited on
    with pytest.raises(ConfigError, match="not a regular file"):
        mb.Plan.load(tmp_path)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as file:
        file.truncate(MAX_PLAN_BYTES + 1)
    with pytest.raises(ConfigError, match="more than a plan's limit"):
        mb.Plan.load(huge)
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        mb.Plan.load(nested)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"workload": "\xff"}')
    with pytest.raises(ConfigError, match="UnicodeDecodeError"):
        mb.Plan.load(binary)


def test_train_with_an_edited_plan_is_one_clear_line(
    tmp_path: Path, plan_data: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan_data, "micro_batch_sizes": [5, 5, 5]}))
    code = cli.main(
        ["train", "--model", "gpt-nano", "--batch", "8", "--plan", str(path), "--out", str(tmp_path / "r")]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "error in your code" not in err
    assert str(path) in err and "field micro_batch_sizes" in err.strip().splitlines()[-1]
    assert not (tmp_path / "r").exists()
