"""microbatch with the transformers Trainer: fit_trainer, HF checkpointing, use_cache through **kwargs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import transformers

import microbatch as mb
from microbatch import hf

BATCH = 8
LENGTH = 32


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed-length random token sequences, as a tokenised dataset gives them."""

    def __init__(self, count: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 256, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _trainer(tmp_path: Any, **args: Any) -> Any:
    model = hf.tiny_llama(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, max_length=LENGTH)
    settings = {
        "output_dir": str(tmp_path),
        "max_steps": 2,
        "per_device_train_batch_size": 1,
        "learning_rate": 1e-3,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        **args,
    }
    arguments = transformers.TrainingArguments(**settings)
    collator = transformers.default_data_collator
    return transformers.Trainer(
        model=model, args=arguments, train_dataset=Sequences(), data_collator=collator
    )


def test_fit_trainer_trains_the_requested_batch_under_the_budget(tmp_path: Any) -> None:
    trainer = _trainer(tmp_path)
    trainer.args.activation_checkpointing = True  # transformers 5's name for gradient_checkpointing
    roomy = hf.fit_trainer(_trainer(tmp_path), batch=BATCH, memory="4GiB", trial=False, policies=["none"])
    assert roomy.steps == 1
    # Between the smallest plan and the whole batch at once: the plan must split or checkpoint.
    budget = (roomy.minimum_bytes + roomy.predicted_peak_bytes) // 2
    plan = hf.fit_trainer(trainer, batch=BATCH, memory=budget, policies=["none", "full"])
    assert plan.micro_batch_size * plan.steps == BATCH and len(set(plan.micro_batch_sizes)) == 1
    assert (plan.micro_batch_size, plan.checkpointed_blocks) != (BATCH, [])  # the budget bound something
    args = trainer.args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        plan.micro_batch_size,
        plan.steps,
    )
    assert args.activation_checkpointing is False and not trainer.model.is_activation_checkpointing
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    with mb.MemoryTracker(model=trainer.model) as tracker:
        trainer.train()
    assert trainer.state.global_step == 2
    assert sum(rows) == 2 * BATCH and set(rows) == {plan.micro_batch_size}  # the effective batch, twice
    assert tracker.peak_bytes <= budget, (tracker.peak_bytes, budget)


def test_checkpoint_turns_hf_gradient_checkpointing_off(caplog: pytest.LogCaptureFixture) -> None:
    model = hf.tiny_llama(num_layers=2)
    model.activation_checkpointing_enable()  # transformers 5's gradient_checkpointing_enable
    assert model.is_activation_checkpointing
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        handle = mb.checkpoint(model, policy="full")
    assert not model.is_activation_checkpointing
    assert "checkpointing_disable()" in caplog.text
    handle.remove()


class KwargsWrapper(nn.Module):
    """A PEFT-style wrapper: forward(**kwargs) passed on, the base model's config exposed."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.config = base.config
        self.seen: list[dict[str, Any]] = []

    def forward(self, **kwargs: Any) -> Any:
        self.seen.append(kwargs)
        return self.base(**kwargs)


def test_causal_lm_loss_turns_the_cache_off_through_kwargs() -> None:
    wrapper = KwargsWrapper(hf.tiny_llama(num_layers=1))
    ids = torch.randint(0, 256, (2, 8))
    loss, items = hf.causal_lm_loss(wrapper, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert wrapper.seen[0]["use_cache"] is False
    assert items == 2 * 7 and loss.ndim == 0
