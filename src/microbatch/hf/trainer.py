"""``fit_trainer``: a plan for a transformers Trainer, applied to it.

The Trainer already accumulates (``gradient_accumulation_steps``) and counts tokens across a window
for models that take ``num_items_in_batch``; what it lacks is the choice. ``fit_trainer`` makes it:

1. profile ``trainer.model`` with batches from the trainer's own train dataset and data collator,
   its optimizer settings and the loss its ``compute_loss`` computes;
2. plan with ``even=True``: the Trainer cannot run a short last micro-batch, so micro-batch x steps x
   ranks == batch exactly (or the nearest batch that splits evenly, with a warning naming it);
3. apply it: microbatch's per-block checkpointing on the model (the Trainer's own gradient
   checkpointing off, so no block is recomputed twice; the cache off, as in any checkpointed
   training), ``per_device_train_batch_size`` = micro-batch, ``gradient_accumulation_steps`` = steps
   (under torch.distributed rank 0 plans and every rank applies its plan);
4. take charge of the loss's weighting (``weighting.exact_loss_weighting``), so the window's gradient
   is the full batch's whatever the model's forward accepts. Every refusal comes before step 3.

The Trainer's effective batch is then ``per_device_train_batch_size * gradient_accumulation_steps *
world_size`` == ``plan.batch_size``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..checkpointing.head import chunk_head
from ..errors import ConfigError
from ..memory import format_bytes, parse_bytes
from ..planner import Plan, plan
from ..trees.batches import batch_size_of, tensor_bytes
from ..workload import Workload
from .lengths import DatasetLengths, lengths_in_refusals, longest_notes, trainer_lengths
from .moe import exact_router_balance
from .token_batches import with_token_windows
from .trainer_peaks import record_window_peaks
from .weighting import ItemCounter, check_exact_supported, exact_loss_weighting

logger = logging.getLogger(__name__)

__all__ = ["fit_trainer", "trainer_workload"]

# Set aside for what the Trainer holds beyond the planner's trial window (gradient clipping, loss
# bookkeeping, accelerate's wrappers): measured 0.1 - 0.4 % of the peak above the trial's on a tiny
# Llama (tests/test_hf_trainer.py), so 1 % of the budget. On the long-tail epoch
# (tests/test_hf_long_tail.py) each Trainer window peaked 8 B above the same micro-batches through
# microbatch's own window, and a tracker around train() 23 KB (0.21 % of the budget) above the worst
# window, 13 KB of it the dataset's rows the collator read (a CPU tracker counts them).
TRAINER_ALLOWANCE = 0.01

# The key of the (rows, 0) marker a padding-free batch carries through the profile (see _examples).
ROWS_KEY = "_microbatch_rows"


def _examples(trainer: Any, lengths: DatasetLengths | None = None) -> Callable[[int], Any]:
    """``make_batch(b)``: the next b examples of the train dataset (cycling), through the collator;
    with ``lengths``, the b longest (hf/lengths.py: the worst micro-batch of b any window can draw)."""
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            "fit_trainer needs trainer.train_dataset with __len__ and __getitem__ (a map-style dataset); "
            "pass train_dataset= to the Trainer"
        )
    if len(dataset) == 0:
        raise ConfigError("fit_trainer: trainer.train_dataset is empty")
    collate = trainer.data_collator
    position = 0

    def make_batch(size: int) -> Any:
        nonlocal position
        if lengths is not None:
            rows = [dataset[i] for i in lengths.longest(size)]
        else:
            rows = [dataset[(position + i) % len(dataset)] for i in range(size)]
            position = (position + size) % len(dataset)
        batch = collate(rows)
        if isinstance(batch, Mapping) and batch_size_of(batch) != size:
            # A padding-free collator (TRL's padding_free / packing) puts the rows into one sequence:
            # an empty (size, 0) tensor first tells the planner how many samples the batch holds.
            batch = {ROWS_KEY: torch.empty(size, 0), **batch}
        return batch

    return make_batch


def _rows(batch: Mapping[str, Any]) -> int:
    """The samples in a batch from ``_examples``: its rows, or the rows a packed batch stands for."""
    marker = batch.get(ROWS_KEY)
    if isinstance(marker, torch.Tensor):
        return int(marker.shape[0])
    return int(next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0))


def trainer_workload(trainer: Any, lengths: DatasetLengths | None = None) -> Workload:
    """A Workload from a Trainer: its model, dataset + collator, ``compute_loss`` and AdamW settings.

    Items are rows: the profile measures memory and time, for which the weighting does not matter.
    With ``lengths`` (``hf.lengths.read_lengths``), ``make_batch(b)`` gives the b longest samples.
    """
    args = trainer.args
    model: nn.Module = trainer.model

    def loss(module: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        inputs = dict(batch)
        if hasattr(getattr(module, "config", None), "use_cache"):
            inputs["use_cache"] = False  # a training forward reads no cache; fit_trainer turns it off too
        rows = _rows(inputs)
        inputs.pop(ROWS_KEY, None)
        value = trainer.compute_loss(module, inputs)
        return value, rows

    def optimizer(module: nn.Module) -> torch.optim.Optimizer:
        # The optimizer the Trainer will build from its arguments (class and settings).
        optimizer_class, settings = type(trainer).get_optimizer_cls_and_kwargs(args, module)
        return optimizer_class([p for p in module.parameters() if p.requires_grad], **settings)  # type: ignore[no-any-return]

    name = type(model).__name__
    longest = lengths.lengths[0] if lengths is not None else None  # Plan.max_tokens: micro x longest
    make_batch = _examples(trainer, lengths)
    return Workload(model, make_batch, loss, optimizer=optimizer, name=name, max_length=longest)


def _turn_off_hf_checkpointing(trainer: Any) -> None:
    model, args = trainer.model, trainer.args
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    flag = (
        "activation_checkpointing"
        if hasattr(type(args), "activation_checkpointing")
        else "gradient_checkpointing"
    )
    if getattr(args, flag, False):
        setattr(args, flag, False)  # the Trainer would enable it again at train()
        logger.warning(
            "fit_trainer: TrainingArguments.%s turned off; microbatch checkpoints the blocks the plan "
            "names instead (both would recompute every block twice)",
            flag,
        )
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a cache built in a training forward is never read
        logger.info("fit_trainer: model.config.use_cache set to False for training")


def fit_trainer(
    trainer: Any,
    *,
    batch: int,
    memory: str | int | float,
    exact: bool = True,
    count_items: ItemCounter | None = None,
    worst_case: bool = True,
    max_tokens: int | str | None = None,
    **plan_options: Any,
) -> Plan:
    """Plan ``batch`` samples per optimizer step in ``memory`` for ``trainer`` and apply the plan.

    Sets ``trainer.args.per_device_train_batch_size`` and ``gradient_accumulation_steps``, checkpoints
    the planned blocks of ``trainer.model``, and returns the plan. ``plan_options`` go to
    ``microbatch.plan`` (blocks, policies, min_micro_batch_size, trial, ...); ``even`` is always True.
    ``exact=True`` (default) weights the loss so the window's gradient is the full batch's on every
    architecture (``exact_loss_weighting``; ``count_items(batch)`` counts items). ``worst_case``: plan on
    the longest samples (hf/lengths.py); ``max_tokens`` ("auto", int): windows cut by tokens. Call before
    train(); after it ``trainer.microbatch_window_peaks.summary()`` states the worst window vs the budget.
    """
    if plan_options.pop("even", True) is not True:
        raise ConfigError("fit_trainer plans with even=True: the Trainer cannot run a short last micro-batch")
    if exact:
        check_exact_supported(trainer)
    world_size = int(getattr(trainer.args, "world_size", 1))
    workload = trainer_workload(trainer, lengths := trainer_lengths(trainer) if worst_case else None)
    budget_bytes = parse_bytes(memory, device=workload.device, name="memory")
    # The Trainer fetches a window's micro-batches at once (to count its items): all but one of them
    # are live beyond what the planner's trial holds.
    window_inputs_bytes = tensor_bytes(workload.make_batch(1)) * (batch // world_size)
    reserve_bytes = window_inputs_bytes + math.ceil(TRAINER_ALLOWANCE * budget_bytes)

    def decide() -> Plan:
        with distributed.single_process():  # this rank's model alone; the others wait for the plan
            return plan(
                workload,
                batch=batch,
                memory=budget_bytes - reserve_bytes,
                world_size=world_size,
                even=True,
                **plan_options,
            )

    # Under torchrun each rank would choose from its own timings, and two plans deadlock DDP: rank 0
    # plans, every rank applies its plan.
    with lengths_in_refusals(lengths):
        result = distributed.decided_on_rank_zero(decide, what="planning for the Trainer")
    note = (
        f"planned within {format_bytes(budget_bytes - reserve_bytes)}: the Trainer holds a window's inputs "
        f"at once ({format_bytes(window_inputs_bytes)}) and keeps its own bookkeeping "
        f"({TRAINER_ALLOWANCE:.0%} of the budget set aside)"
    )
    notes = (*result.notes, note, *longest_notes(lengths, result.micro_batch_size))
    _turn_off_hf_checkpointing(trainer)  # the model's own flag: mb.checkpoint turns it off
    if exact:
        notes = (*notes, *_exact_weighting(trainer, count_items))
    result = dataclasses.replace(result, budget_bytes=budget_bytes, notes=notes)
    _apply(trainer, result, world_size)
    return with_token_windows(trainer, result, max_tokens, batch=batch)


def _exact_weighting(trainer: Any, count_items: Any) -> tuple[str, ...]:
    """Install the exact window weighting, and a MoE's load-balancing loss over the window (hf/moe.py)."""
    notes = (exact_loss_weighting(trainer, count_items=count_items),)
    balance = exact_router_balance(trainer)
    return notes if balance is None else (*notes, balance)


def _apply(trainer: Any, result: Plan, world_size: int) -> None:
    """The plan's checkpointing on the model, its micro-batch and steps on the Trainer's arguments;
    each window's peak recorded against the budget."""
    result.checkpoint(trainer.model)
    if result.head_chunk_tokens is not None:  # the plan's loss head in chunks (checkpointing/head.py)
        chunk_head(trainer.model, tokens=result.head_chunk_tokens)
    trainer.args.per_device_train_batch_size = result.micro_batch_size
    trainer.args.gradient_accumulation_steps = result.steps
    trainer._train_batch_size = trainer.args.train_batch_size  # the Trainer caches it at __init__
    record_window_peaks(trainer, budget_bytes=result.budget_bytes)  # every window's peak (trainer_peaks)
    logger.info(
        "fit_trainer: per_device_train_batch_size=%d, gradient_accumulation_steps=%d, world_size=%d "
        "(batch %d); checkpointed %d block(s)",
        result.micro_batch_size,
        result.steps,
        world_size,
        result.batch_size,
        len(result.checkpointed_blocks),
    )
