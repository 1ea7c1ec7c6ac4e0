"""examples/contrastive_finetune.py at tiny size: it plans, trains at the large batch and learns."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_contrastive_finetune_example_learns_within_the_small_batch_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "contrastive_finetune.py"
    spec = importlib.util.spec_from_file_location("contrastive_finetune", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    before, after = example.main(
        ["--batch", "32", "--fits", "4", "--length", "16", "--steps", "6", "--lr", "3e-3"]
    )
    assert after < before - 0.05, (before, after)  # 3.26 -> 3.06 when written
    printed = capsys.readouterr().out
    assert "cached_backward: batch 32 encoded in micro-batches of" in printed and "step 5:" in printed
    # The budget of a plain step at batch 4 holds a cached step at batch 32 (proved by the trial).
    assert "measured" in printed
