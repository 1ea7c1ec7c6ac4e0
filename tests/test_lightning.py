"""microbatch.lightning.ExactAccumulation: Lightning's automatic accumulation with the full window's gradient.

The example (examples/lightning_automatic.py) trains 18 variable-length sequences, micro-batch 4,
accumulate_grad_batches 4: a window of 16 sequences and the epoch's short last window of 2. The
reference is plain SGD (lr 0.5) on each full window's token-mean loss, from the same initial weights,
float64: rtol 1e-10, atol 1e-12 (summation order). Without the callback the same run is off by
percents (checked too, so the comparison can fail).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("lightning")

from microbatch.errors import ConfigError
from microbatch.lightning import ExactAccumulation

TOL = {"rtol": 1e-10, "atol": 1e-12}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_automatic", EXAMPLES / "lightning_automatic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(example: Any, windows: list[int]) -> Any:
    torch.manual_seed(0)
    module = example.NextToken().double()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    rows, start = example.sequences(sum(windows)), 0
    for size in windows:
        batch = example.collate(rows[start : start + size])  # the whole window at once
        logits = module.net(batch["input_ids"])
        optimizer.zero_grad()
        F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
        optimizer.step()
        start += size
    return module


def _distance(a: Any, b: Any) -> float:
    return max(
        float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_accumulate_grad_batches_is_exact_with_the_callback() -> None:
    example = _example()
    module, trainer = example.main(["--samples", "18", "--micro-batch", "4", "--steps", "4"])
    assert trainer.global_step == 2  # a full window and the epoch's short last one
    reference = _reference(example, [16, 2])
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
    assert "training_step" not in vars(module)  # the wrapper is gone after fit


def test_plain_accumulate_grad_batches_is_off() -> None:
    example = _example()
    module, _ = example.main(["--samples", "18", "--micro-batch", "4", "--steps", "4", "--plain"])
    assert _distance(module, _reference(example, [16, 2])) > 1e-3


def test_manual_optimization_is_refused() -> None:
    import lightning as L

    example = _example()
    module = example.NextToken()
    module.automatic_optimization = False
    trainer = L.Trainer(
        max_epochs=1, callbacks=[ExactAccumulation()], logger=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigError, match="automatic optimization"):
        trainer.fit(
            module,
            torch.utils.data.DataLoader(example.sequences(4), batch_size=2, collate_fn=example.collate),
        )


def test_a_plan_sets_the_accumulation_and_stays_exact() -> None:
    import lightning as L

    import microbatch as mb

    example = _example()
    torch.manual_seed(0)
    module = example.NextToken().double()
    rows = example.sequences(16)

    def loss(net: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        labels = batch["labels"]
        value = F.cross_entropy(net(batch["input_ids"]).flatten(0, 1), labels.flatten(), ignore_index=-100)
        return value, int((labels != -100).sum())

    workload = mb.Workload(model=module.net, make_batch=lambda b: example.collate(rows[:b]), loss=loss)
    plan = mb.plan(workload, batch=16, memory="1GiB", trial=False, policies=["none"], min_micro_batch_size=4)
    loader = torch.utils.data.DataLoader(rows, batch_size=plan.micro_batch_size, collate_fn=example.collate)
    trainer = L.Trainer(
        max_epochs=1, callbacks=[ExactAccumulation(plan=plan, model=module.net)], accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    assert trainer.accumulate_grad_batches == plan.steps
    assert trainer.global_step == 1  # the plan's window is the whole batch of 16
    for p, q in zip(module.parameters(), _reference(example, [16]).parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
