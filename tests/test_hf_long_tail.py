"""fit_trainer on long-tailed data (issue 33): planned on the longest samples, a whole epoch through
the real Trainer peaks within the budget by a tracker opened outside the planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

import microbatch as mb
from microbatch import hf
from microbatch.errors import InfeasibleBudgetError
from microbatch.hf.lengths import read_lengths, sample_length
from microbatch.hf.trainer import TRAINER_ALLOWANCE
from microbatch.hf.trainer_peaks import record_window_peaks
from microbatch.profile.runs import train_window

PAD, BATCH = 0, 16


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the micro-batch's longest row, as DataCollatorForLanguageModeling does."""
    ids = [e["input_ids"] for e in examples]

    def pad(rows: list[torch.Tensor], value: int) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)

    mask = [torch.ones_like(i) for i in ids]
    return {"input_ids": pad(ids, PAD), "attention_mask": pad(mask, 0), "labels": pad(ids, -100)}


class LongTail(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """128 samples: 112 chat turns of 12-24 tokens, then 16 documents of 180-200 (stored last)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        short = torch.randint(12, 25, (112,), generator=generator).tolist()
        long = torch.randint(180, 201, (16,), generator=generator).tolist()
        self.rows = [torch.randint(3, 256, (n,), generator=generator) for n in short + long]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


def _trainer(tmp_path: Any, dataset: LongTail) -> Any:
    torch.manual_seed(0)
    model = hf.tiny_llama(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, max_length=256)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=1, learning_rate=1e-3,
        report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        logging_steps=1000,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=collate)


def _two_longest_step_peak(model: torch.nn.Module, dataset: LongTail) -> int:
    """The measured peak of one training step on a micro-batch of the two longest samples."""
    longest = sorted(range(len(dataset)), key=lambda i: -len(dataset.rows[i]))[:2]
    batch = collate([dataset[i] for i in longest])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
        model(**batch).loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_lengths_are_read_from_the_samples_and_sampled_when_long() -> None:
    dataset = LongTail()
    lengths = read_lengths(dataset)
    assert lengths is not None and not lengths.sampled
    assert list(lengths.lengths) == sorted((len(r) for r in dataset.rows), reverse=True)
    assert [len(dataset.rows[i]) for i in lengths.longest(3)] == list(lengths.lengths[:3])
    sampled = read_lengths(dataset, max_scan=10)
    assert sampled is not None and sampled.sampled and len(sampled.lengths) == 10
    assert "10 of 128 samples read" in sampled.describe()
    assert sample_length({"input_ids": [1, 2, 3], "labels": [1]}) == 3
    assert sample_length({"label": torch.tensor(1)}) is None


@pytest.mark.parametrize("max_tokens", [None, "auto"])
def test_long_tail_epoch_peaks_within_the_budget(
    tmp_path: Any, one_torch_thread: None, max_tokens: str | None
) -> None:
    dataset = LongTail()
    budget = int(1.25 * _two_longest_step_peak(_trainer(tmp_path, dataset).model, dataset))
    trainer = _trainer(tmp_path, dataset)
    options = {"max_profile_micro_batch_size": 8, "max_tokens": max_tokens}
    result = hf.fit_trainer(trainer, batch=BATCH, memory=budget, **options)
    assert result.micro_batch_size * result.steps == BATCH
    two = sorted((len(r) for r in dataset.rows), reverse=True)[: result.micro_batch_size]
    shown = ", ".join(str(n) for n in two)
    assert any(f"longest samples: {shown} tokens" in note for note in result.notes), result.notes
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    tokens: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    with mb.MemoryTracker(model=trainer.model) as tracker:
        trainer.train()
    assert max(rows) >= 180  # the epoch met the long samples
    if max_tokens is not None:  # every micro-batch within the plan's padded tokens, all samples seen
        assert result.max_tokens == result.micro_batch_size * max(len(r) for r in dataset.rows)
        sampler = trainer.microbatch_token_sampler
        assert sum(len(w) for w in sampler.windows()) == len(dataset)
        assert max(tokens) <= result.max_tokens
    assert tracker.peak_bytes <= budget, (tracker.peak_bytes, budget)
    # fit_trainer's own record of the epoch (hf/trainer_peaks.py): every window, the worst within the
    # budget, and no higher than the tracker opened outside sees (it holds every window).
    peaks = trainer.microbatch_window_peaks
    summary = peaks.summary()
    assert len(peaks.records) == len(dataset) // BATCH and [r["step"] for r in peaks.records] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
    ]
    assert summary["budget_bytes"] == budget and summary["windows_over_budget"] == 0
    assert 2 <= summary["windows_measured"] <= len(peaks.records)
    measured = max(r["peak_bytes"] for r in peaks.records if r["peak_measured"])
    assert measured <= tracker.peak_bytes
    assert summary["worst_window_peak_bytes"] <= budget
    assert trainer.state.log_history[-1]["microbatch_window_peaks"] == summary


def test_a_refusal_names_the_lengths_it_planned_for(tmp_path: Any, one_torch_thread: None) -> None:
    dataset = LongTail()
    trainer = _trainer(tmp_path, dataset)
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    with pytest.raises(InfeasibleBudgetError, match=r"longest samples of the dataset, 200, \d+"):
        hf.fit_trainer(trainer, batch=BATCH, memory=6 * weights, max_profile_micro_batch_size=2, trial=False)
    assert trainer.args.per_device_train_batch_size == 1  # nothing changed


def test_what_the_trainer_adds_to_a_window_is_within_its_allowance(
    tmp_path: Any, one_torch_thread: None
) -> None:
    """The Trainer's own memory on the long-tail epoch: each window it measured (fit_trainer's record)
    against the same micro-batches through microbatch's window (the planner's trial: the Accumulator,
    the optimizer's state created first, the inputs counted from the start), on the same model.
    The difference (gradient clipping, loss bookkeeping, accelerate's wrappers) must fit the 1 % of the
    budget fit_trainer sets aside (TRAINER_ALLOWANCE). Measured: 8 B in each of windows 2-8 (the peak is
    in a micro-batch's backward, where the Trainer holds nothing of its own; its clipping comes after).
    ``windows`` holds each window's inputs by reference (no op: nothing a tracker would count)."""
    dataset = LongTail()
    budget = int(1.25 * _two_longest_step_peak(_trainer(tmp_path, dataset).model, dataset))
    trainer = _trainer(tmp_path, dataset)
    hf.fit_trainer(trainer, batch=BATCH, memory=budget, max_profile_micro_batch_size=8)
    windows: dict[int, list[Any]] = {}
    measured_batch_samples = trainer.get_batch_samples

    def keep(*args: Any, **kwargs: Any) -> Any:
        batch_samples, items = measured_batch_samples(*args, **kwargs)
        windows[trainer.state.global_step + 1] = [dict(b) for b in batch_samples]
        return batch_samples, items

    trainer.get_batch_samples = keep
    trainer.microbatch_window_peaks.peak.every = 1  # every window measured
    trainer.train()
    workload = hf.trainer_workload(trainer)
    model = trainer.model
    optimizer = workload.make_optimizer()
    for parameter in model.parameters():  # the state made by a step on zero gradients, as the trial does
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    extra = []
    for record in trainer.microbatch_window_peaks.records:
        if not record["peak_measured"] or record["step"] == 1:  # window 1: the Trainer's state not yet made
            continue
        batches = windows[record["step"]]
        accumulator = mb.Accumulator(model, optimizer, steps=len(batches))
        with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
            tracker.track(batches)
            train_window(workload, accumulator, iter(list(batches)))
        extra.append(record["peak_bytes"] - tracker.peak_bytes)
    assert len(extra) == len(dataset) // BATCH - 1
    assert max(extra) <= TRAINER_ALLOWANCE * budget, (extra, budget)
    print(f"the Trainer adds at most {max(extra)} B to a window ({max(extra) / budget:.4%} of the budget)")


def test_the_window_record_can_be_removed(tmp_path: Any, one_torch_thread: None) -> None:
    trainer = _trainer(tmp_path, LongTail())
    before = (trainer.get_batch_samples, trainer.train, trainer.callback_handler.on_step_end)
    record = record_window_peaks(trainer, budget_bytes=2**30)
    assert trainer.microbatch_window_peaks is record and trainer.get_batch_samples != before[0]
    record.remove()
    assert (trainer.get_batch_samples, trainer.train, trainer.callback_handler.on_step_end) == before
    assert not hasattr(trainer, "microbatch_window_peaks")
    trainer.args.max_steps = 1
    trainer.train()
    assert record.records == []
