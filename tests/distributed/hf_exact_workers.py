"""What each rank runs in the 2-rank HF Trainer tests: one optimizer step of a tiny float64 model whose
loss fit_trainer weights, on a dataset whose halves (one per rank) hold different numbers of items."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

from microbatch import hf

MICRO, STEPS, WORLD = 4, 2, 2
SAMPLES = MICRO * STEPS * WORLD  # one optimizer step: every sample once


def examples(name: str) -> list[dict[str, torch.Tensor]]:
    """``SAMPLES`` rows; the Trainer deals micro-batch b to rank b % WORLD (accelerate's batch sharding),
    so rows of even micro-batches are long and those of odd ones short: the ranks' counts differ."""
    import test_hf_exact as exact

    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(SAMPLES):
        long = (index // MICRO) % WORLD == 0
        low, high = (14, 20) if long else (3, 6)
        length = int(torch.randint(low, high, (1,), generator=generator))
        ids = torch.randint(3, exact.VOCAB, (length,), generator=generator)
        if name.endswith("classification"):
            label = torch.randint(0, 3, (), generator=generator)
            if not long and index % 2:
                label = torch.tensor(-100)  # a sample the loss ignores: the ranks' sample counts differ too
            rows.append({"input_ids": ids, "labels": label})
        else:
            labels = ids.clone()
            labels[: int(torch.randint(0, 3, (1,), generator=generator))] = -100  # a masked prompt
            rows.append({"input_ids": ids, "labels": labels})
    return rows


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def first_step(name: str, fit: bool) -> dict[str, Any]:
    """One step of the Trainer on this rank: ``fit`` plans it with fit_trainer (else micro 4 x 2 steps
    with exact_loss_weighting alone); the gradient the optimizer sees, the items this rank counted."""
    import test_hf_exact as exact

    model = exact._model(name)
    with tempfile.TemporaryDirectory() as folder:
        trainer = exact._trainer(folder, model, Rows(examples(name)), steps=STEPS)
        trainer.args.per_device_train_batch_size = MICRO
        trainer._train_batch_size = MICRO
        if fit:
            plan = hf.fit_trainer(trainer, batch=SAMPLES, memory="2GiB", trial=False, policies=["none"])
            chosen = (plan.micro_batch_size, plan.steps)
            planning_seconds = plan.planning_seconds
        else:
            hf.exact_loss_weighting(trainer)
            chosen, planning_seconds = (MICRO, STEPS), None
        counted: list[int] = []
        compute_loss = trainer.compute_loss

        def counting_compute_loss(module: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            labels = inputs["labels"]
            counted.append(int((labels[..., 1:] if labels.dim() > 1 else labels).ne(-100).sum()))
            return compute_loss(module, inputs, *args, **kwargs)

        trainer.compute_loss = counting_compute_loss
        grads = exact._first_step(trainer)
    return {
        "rank": dist.get_rank(),
        "world_size": trainer.args.world_size,
        "plan": chosen,
        "planning_seconds": planning_seconds,
        "items": counted,
        "grads": grads,
    }


CASES = [("llama-causal-lm", False), ("bert-sequence-classification", False), ("llama-causal-lm", True)]


def all_cases() -> list[dict[str, Any]]:
    """Every case in one launch (spawning two ranks costs more than the steps)."""
    from accelerate.state import AcceleratorState, GradientState

    results = []
    for name, fit in CASES:
        results.append(first_step(name, fit))
        GradientState._reset_state()  # a Trainer with accumulation leaves it accumulating (tests/conftest.py)
        AcceleratorState._reset_state()
    return results
