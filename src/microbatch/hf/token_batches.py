"""Token budgets for the Trainer: each window cut into micro-batches by padded tokens.

The Trainer draws a window of ``batch`` samples (shuffled, as its sampler does) and runs a fixed
number of micro-batches per optimizer step. ``TokenWindowSampler`` keeps both: every window holds
the same ``batch`` samples a row plan would give it (the same shuffle, the effective batch kept),
sorted longest first and cut greedily into micro-batches of at most ``max_tokens`` padded tokens
(rows x the longest row's length). A window needs at most ``steps`` of them, the count the
``batch`` longest samples of the dataset need; a window that needs fewer is filled up with empty
micro-batches: one sample whose labels are all -100, so it holds no items and adds nothing to the
gradient (``weighting.exact_loss_weighting`` weights each micro-batch by its items / the
window's). The window's gradient is therefore the full batch's, whatever the cut.

Why ``max_tokens = micro_batch_size x longest`` holds the plan's budget: the plan was profiled and
proved on ``micro_batch_size`` rows of the longest length (hf/lengths.py), and a micro-batch of r
rows padded to T <= longest with r T <= max_tokens needs no more activation memory, per token or
quadratic in T (planner/result/token_budget.py derives it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..planner import Plan
from .lengths import sample_length
from .weighting import IGNORE_INDEX

logger = logging.getLogger(__name__)

__all__ = ["TokenWindowSampler", "cut_by_tokens", "use_token_windows", "with_token_windows"]

LABEL_KEYS = ("labels", "shift_labels")


def cut_by_tokens(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """``indices`` longest first, cut into micro-batches of at most ``max_tokens`` padded tokens (a
    sample longer than ``max_tokens`` alone in its own)."""
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    pieces: list[list[int]] = []
    for index in ordered:
        # Longest first: the piece's first row sets its padded length.
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= max_tokens:
            pieces[-1].append(index)
        else:
            pieces.append([index])
    return pieces


class TokenWindowSampler(torch.utils.data.Sampler[list[int]]):
    """Micro-batches of dataset indices: windows of ``batch`` shuffled samples, each cut by tokens
    into exactly ``steps`` micro-batches (empty ones marked ``[-1 - i]``, i a sample of the window)."""

    def __init__(self, lengths: Sequence[int], *, batch: int, max_tokens: int, seed: int = 0) -> None:
        if max_tokens < max(lengths):
            raise ConfigError(
                f"max_tokens={max_tokens} is below the longest sample ({max(lengths)} tokens); raise it, "
                "or shorten the longest samples"
            )
        self.lengths, self.batch, self.max_tokens, self.seed = list(lengths), batch, max_tokens, seed
        self.epoch = 0
        longest = sorted(range(len(self.lengths)), key=lambda i: -self.lengths[i])[:batch]
        self.steps = len(cut_by_tokens(longest, self.lengths, max_tokens))  # no window needs more

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def windows(self) -> list[list[int]]:
        """This epoch's windows of sample indices, in the order they train."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        return [order[start : start + self.batch] for start in range(0, len(order), self.batch)]

    def __iter__(self) -> Iterator[list[int]]:
        for window in self.windows():
            pieces = cut_by_tokens(window, self.lengths, self.max_tokens)
            shortest = pieces[-1][-1]
            yield from pieces
            for _ in range(self.steps - len(pieces)):
                yield [-1 - shortest]

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch) * self.steps


class _Marked(torch.utils.data.Dataset[Any]):
    """The dataset, with index ``-1 - i`` standing for sample i in an empty micro-batch."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return ("empty", self.dataset[-1 - index]) if index < 0 else self.dataset[index]


def _collate_marked(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def collate_with_empty(samples: list[Any]) -> Any:
        empty = [s for s in samples if isinstance(s, tuple) and len(s) == 2 and s[0] == "empty"]
        if not empty:
            return collate(samples)
        batch = collate([empty[0][1]])
        if not isinstance(batch, Mapping) or not any(k in batch for k in LABEL_KEYS):
            raise ConfigError("token windows need the collated batch's 'labels' to empty a micro-batch")
        batch = dict(batch)
        for key in LABEL_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = torch.full_like(batch[key], IGNORE_INDEX)  # no items: adds nothing
        return batch

    return collate_with_empty


def use_token_windows(trainer: Any, lengths: Sequence[int], *, batch: int, max_tokens: int) -> str:
    """Make ``trainer`` draw its windows from a TokenWindowSampler; returns the plan's note."""
    if int(getattr(trainer.args, "world_size", 1)) > 1:
        raise ConfigError(
            "fit_trainer(max_tokens=...) runs on one process; leave max_tokens out under torchrun"
        )
    sampler = TokenWindowSampler(lengths, batch=batch, max_tokens=max_tokens, seed=int(trainer.args.seed))
    args = trainer.args

    def get_train_dataloader() -> Any:
        # As the Trainer's own loader: columns the model does not take are dropped by the collator.
        collate = trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
        loader = torch.utils.data.DataLoader(
            _Marked(trainer.train_dataset),
            batch_sampler=sampler,
            collate_fn=_collate_marked(collate),
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
        )
        return trainer.accelerator.prepare(loader)

    trainer.get_train_dataloader = get_train_dataloader
    args.gradient_accumulation_steps = sampler.steps
    args.per_device_train_batch_size = max(1, batch // sampler.steps)  # the Trainer's logs only
    trainer._train_batch_size = args.train_batch_size
    trainer.microbatch_token_sampler = sampler
    return (
        f"token budget: each window of {batch} samples cut into micro-batches of at most {max_tokens} padded "
        f"tokens, {sampler.steps} per window (what the {batch} longest samples need; a window needing fewer "
        "is filled with empty micro-batches that add nothing)"
    )


def with_token_windows(trainer: Any, plan: Plan, max_tokens: int | str | None, *, batch: int) -> Plan:
    """fit_trainer's ``max_tokens``: None (rows), "auto" (the plan's: micro-batch x the longest sample,
    profiled and proved on exactly that) or a number of padded tokens. Returns the plan with its note."""
    if max_tokens is None:
        return plan
    if max_tokens == "auto":
        if plan.max_tokens is None:
            raise ConfigError(
                "fit_trainer(max_tokens='auto') needs samples of varying length read with worst_case=True; "
                "pass max_tokens=<int> or leave it out"
            )
        max_tokens = int(plan.max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(
            f"fit_trainer: max_tokens must be 'auto', a positive int or None, got {max_tokens!r}"
        )
    dataset = trainer.train_dataset
    lengths = [sample_length(dataset[i]) for i in range(len(dataset))]  # every one: the sampler cuts by them
    known = [n for n in lengths if n is not None]
    if len(known) != len(lengths):
        raise ConfigError("fit_trainer(max_tokens=...) needs samples with input_ids (a length each)")
    note = use_token_windows(trainer, known, batch=batch, max_tokens=max_tokens)
    return dataclasses.replace(plan, notes=(*plan.notes, note), max_tokens=max_tokens)
