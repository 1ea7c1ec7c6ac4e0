"""print(plan): the * on the chosen row, grouped block rows, columns that fit their names (issue 25)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import microbatch as mb
from microbatch.cli import main
from microbatch.hf.configs import ARCHITECTURES
from microbatch.planner.result.plans import FrontierPoint
from microbatch.planner.result.text import block_rows, frontier_rows

NONE_X4 = tuple((f"blocks.{i}", "none") for i in range(4))
FULL_X4 = tuple((f"blocks.{i}", "full") for i in range(4))


def planned(
    frontier: tuple[FrontierPoint, ...], *, micro: int, policies: tuple[tuple[str, str], ...]
) -> mb.Plan:
    manual = mb.Plan.manual(batch_size=64, micro_batch_size=micro, policies=dict(policies))
    return dataclasses.replace(
        manual,
        source="planner",
        budget_bytes=60 * 2**20,
        predicted_peak_bytes=49 * 2**20,
        predicted_seconds_per_step=0.213,
        frontier=frontier,
    )


def point(
    micro: int, policies: tuple[tuple[str, str], ...], peak_mib: float, seconds: float
) -> FrontierPoint:
    return FrontierPoint(micro, -(-64 // micro), policies, int(peak_mib * 2**20), seconds)


def starred_rows(text: str) -> list[str]:
    table = text.split("Frontier (")[1].splitlines()[2:]
    return [row for row in table if row.startswith("  *")]


def test_the_star_marks_the_chosen_row_when_it_is_on_the_frontier() -> None:
    frontier = (
        point(64, NONE_X4, 156, 0.134),
        point(32, FULL_X4, 64, 0.178),
        point(16, NONE_X4, 49, 0.213),
        point(8, FULL_X4, 30, 0.3),
    )
    text = str(planned(frontier, micro=16, policies=NONE_X4))
    (row,) = starred_rows(text)
    assert row.split()[1:5] == ["16", "4", "none", "x4"]
    assert "not on the frontier" not in text


def test_a_chosen_plan_off_the_frontier_gets_its_own_starred_row() -> None:
    # The planner's tie rule may choose a plan another one dominates (search.choose): the star used to
    # fall on the first row (micro-batch 64, which does not even fit the budget).
    frontier = (point(64, NONE_X4, 156, 0.134), point(16, FULL_X4, 40, 0.2), point(8, FULL_X4, 30, 0.3))
    plan = planned(frontier, micro=16, policies=NONE_X4)
    rows, index, on_frontier = frontier_rows(plan)
    assert not on_frontier
    assert [row[0] for row in rows] == [64, 16, 16, 8]  # placed by its time (0.213 s), fastest first
    assert index == 2 and rows[index][2] == "none x4"
    text = str(plan)
    (row,) = starred_rows(text)
    assert row.split()[1:5] == ["16", "4", "none", "x4"]
    assert "not on the frontier itself" in text


def test_thirty_two_numbered_blocks_are_one_line_that_keeps_which_block_differs() -> None:
    policies = (("model.layers.0", "full"), *((f"model.layers.{i}", "none") for i in range(1, 32)))
    assert block_rows(policies) == [("model.layers.0-31", "none x31, full x1 (full: 0)")]
    few = (("embed", "none"), ("h.0", "full"), ("h.1", "none"), ("head", "none"))
    assert block_rows(few) == list(few)  # short runs keep a row per block


def test_long_block_names_get_a_column_wide_enough() -> None:
    names = {f"base_model.model.transformer.h.{i}": "none" for i in range(3)}
    plan = dataclasses.replace(planned((), micro=16, policies=tuple(names.items())))
    rows = [line for line in str(plan).splitlines() if "base_model" in line]
    assert len(rows) == 3
    assert len({row.index("none") for row in rows}) == 1  # one column, not pushed by each name
    assert all(row.split()[0] in names and row.split()[1] == "none" for row in rows)


def test_a_simulated_architecture_names_every_layer_not_the_three_simulated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "six-layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**ARCHITECTURES["gpt2"], "n_layer": 6}))
    argv = ["plan", str(folder / "config.json"), "--device", "l4", "--batch", "4", "--seq-len", "64"]
    assert main([*argv, "--memory", "4GiB", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "picked 3 " not in out
    assert "blocks='auto' picked 6 GPT2Block blocks (transformer.h.0 .. transformer.h.5)" in out
    assert (
        "transformer.h.0, transformer.h.1 and transformer.h.5 simulated (the first, a middle and the last), "
        "the middle one's costs repeated for the other 3"
    ) in out
    block_lines = [line for line in out.splitlines() if line.startswith("  transformer.h.")]
    assert len(block_lines) == 1 and block_lines[0].split()[0] == "transformer.h.0-5"
    assert "1 ranks" not in out and "shard none, 1 rank)" in out
