"""``microbatch train --max-tokens``: the same training as fixed rows, with the padding saved recorded.

Tolerance: the runs are float32; splitting a window differently only reorders float sums, so the
first step's loss agrees to rtol 1e-5 and the weights after three AdamW steps to rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from microbatch import cli
from microbatch.errors import ConfigError
from microbatch.training.max_tokens import parse_max_tokens, resolve_max_tokens
from microbatch.training.run_folder import load_checkpoint

NANO = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--no-progress")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(out: Path, *extra: str) -> list[dict[str, Any]]:
    assert cli.main(["train", *NANO, "--steps", "3", "--out", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_token_budget_trains_like_rows_and_records_padding_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    by_tokens = train(tmp_path / "tokens")  # the default: --max-tokens auto
    by_rows = train(tmp_path / "rows", "--max-tokens", "off")
    capsys.readouterr()
    plan = json.loads((tmp_path / "rows" / "plan.json").read_text())
    assert plan["micro_batch_size"] < 8  # the budget makes the rows run accumulate
    assert by_tokens[0]["loss"] == pytest.approx(by_rows[0]["loss"], rel=1e-5)
    assert [r["items"] for r in by_tokens] == [r["items"] for r in by_rows]  # the same sequences
    for tokens, rows in zip(by_tokens, by_rows, strict=True):
        assert "padding_saved_tokens" not in rows
        assert tokens["padding_saved_tokens"] > 0 and tokens["padded_tokens"] >= tokens["items"]
        assert tokens["padding_fraction"] < tokens["padding_fraction_rows"]
        assert tokens["micro_batches"] <= rows["micro_batches"]
    states = [load_checkpoint(str(tmp_path / name / "checkpoint.pt"))["model"] for name in ("tokens", "rows")]
    for name in states[1]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=1e-4, atol=1e-5)


def test_max_tokens_values() -> None:
    assert parse_max_tokens("128") == 128 and parse_max_tokens("auto") == "auto"
    assert resolve_max_tokens("auto", micro_batch_size=3, block_size=32) == 96
    assert resolve_max_tokens("off", micro_batch_size=3, block_size=32) is None
    with pytest.raises(ConfigError, match="--max-tokens"):
        parse_max_tokens("lots")
    with pytest.raises(ConfigError, match="less than the model's block_size 32"):
        resolve_max_tokens(16, micro_batch_size=3, block_size=32)
