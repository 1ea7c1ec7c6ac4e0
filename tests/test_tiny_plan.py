"""A tiny MLP under a roomy budget: the search goes past the smallest plan, and --json is compact
(issue 25, point 13)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from microbatch.cli import main
from microbatch.commands.output import dumps
from test_cli_names import MLP_MODULE


def test_a_tiny_mlp_is_not_planned_as_the_smallest_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tiny_mlp.py").write_text(MLP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tiny_mlp", raising=False)
    assert main(["plan", "tiny_mlp:mlp", "--batch", "512", "--memory", "2MiB", "--json"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out)
    # 512 micro-batches of one pay the per-micro-batch cost 512 times; the whole batch fits in 2 MiB.
    assert plan["micro_batch_size"] > 1, plan["micro_batch_sizes"]
    assert plan["predicted_peak_bytes"] > plan["minimum_bytes"]
    assert len(plan["frontier"]) > 1
    sizes_line = next(line for line in out.splitlines() if '"micro_batch_sizes"' in line)
    assert json.loads(sizes_line.split(":", 1)[1].rstrip(",")) == plan["micro_batch_sizes"]  # one line
    assert len(out.splitlines()) < 20 * len(plan["frontier"]) + 60


def test_compact_json_is_the_same_value() -> None:
    value = {"sizes": [1] * 512, "frontier": [{"policies": {}, "sizes": [2, 3]}], "none": None, "empty": []}
    text = dumps(value)
    assert json.loads(text) == value
    assert text.count("\n") == 10  # 11 lines, however long the lists
    assert '"sizes": [1, 1, ' in text
