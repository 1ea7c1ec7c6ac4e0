"""The Trainer's loss weighted by the window's items: exact accumulation for every architecture.

A Trainer window of k micro-batches (over W ranks) must give the full-batch gradient of

    L = sum_{ranks, micro-batches, items} loss_item / N,   N = the window's items on every rank,

where an item is what the model's loss averages over: a shifted label that is not -100 for a causal
LM, a label that is not -100 for a masked LM, a token classifier or a seq2seq decoder, a sample
for sequence classification (its ``labels`` has one entry per sample). The model's own loss on a
micro-batch is the mean over its n items, so the micro-batch contributes

    loss_micro * n / N * W                          (DDP then averages the W ranks' gradients).

The Trainer only gets there when the model takes ``num_items_in_batch`` and divides by it; it
skips its own division by the accumulation steps for any forward that declares ``**kwargs``, even
heads that never pass the count to their loss (transformers #47688), and for GPT-2 (``loss_type``
None) it counts unshifted labels. ``exact_loss_weighting(trainer)`` takes the weighting over: the
model is never given ``num_items_in_batch`` (it returns its plain mean), the window is counted here
by the rule above, and the Trainer is told the loss is already scaled for accumulation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["check_exact_supported", "count_items_rule", "exact_loss_weighting"]

IGNORE_INDEX = -100

ItemCounter = Callable[[Mapping[str, Any]], torch.Tensor]


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under accelerate's / PEFT's wrappers."""
    while True:
        inner = getattr(model, "module", None)  # DDP, DataParallel
        if callable(getattr(model, "get_base_model", None)):  # PEFT
            inner = model.get_base_model()  # type: ignore[operator]
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the loss predicts label t+1 from position t (a decoder-only causal LM head)."""
    base = _base_model(model)
    config = getattr(base, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False  # its decoder inputs are the labels shifted right: every label is a target
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is installed with the hf extra
        return False
    # By class, not by loss_type: GPT-2's is None in transformers 5.24, yet its loss shifts.
    return type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def count_items_rule(model: nn.Module) -> ItemCounter:
    """``count(inputs)``: the items the model's own loss averages over in one collated batch.

    ``shift_labels`` (padding-free collators) count as given; a causal LM counts ``labels[..., 1:]``;
    any other head counts ``labels`` that are not -100 (one per sample for sequence classification,
    every element of float labels for regression and multi-label heads).
    """
    shifts = _shifts_labels(model)

    def count(inputs: Mapping[str, Any]) -> torch.Tensor:
        if isinstance(inputs.get("shift_labels"), torch.Tensor):
            return (inputs["shift_labels"] != IGNORE_INDEX).sum()  # type: ignore[no-any-return]
        labels = inputs.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ConfigError(
                "exact loss weighting needs each batch's 'labels' to count the items the loss averages "
                f"over (this batch has {sorted(inputs)}); pass count_items=fn(batch) -> items"
            )
        counted = labels[..., 1:] if shifts and labels.dim() > 1 else labels
        return (counted != IGNORE_INDEX).sum()

    return count


# TRL DPO losses that are a mean over the batch's pairs of a per-pair term (dpo_trainer.py, TRL 1.16):
# these are exact when each micro-batch's mean is weighted by its pairs. "sft" is a mean over the chosen
# completions' tokens (a token count would be needed), "aot" / "aot_unpaired" sort the scores across
# the batch, so a micro-batch's loss is no part of the full batch's.
PER_PAIR_DPO_LOSSES = frozenset(
    {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
     "apo_down", "discopop", "sigmoid_norm"}
)  # fmt: skip


def _count_pairs(inputs: Mapping[str, Any]) -> torch.Tensor:
    """A preference batch stacks the chosen rows over the rejected ones: half its rows are pairs."""
    return torch.tensor(inputs["input_ids"].shape[0] // 2)


def _trainer_counter(trainer: Any) -> ItemCounter:
    """The item rule for ``trainer``: pairs for TRL's DPOTrainer, else ``count_items_rule``."""
    if not count_is_pairs(trainer):
        return count_items_rule(trainer.model)
    loss_types = set(getattr(trainer, "loss_types", None) or [getattr(trainer.args, "loss_type", "sigmoid")])
    if not loss_types <= PER_PAIR_DPO_LOSSES:
        raise ConfigError(
            f"DPOConfig.loss_type {sorted(loss_types - PER_PAIR_DPO_LOSSES)} is not a mean over pairs "
            "('sft' averages tokens, 'aot' sorts across the batch), so a micro-batch's loss is no part of "
            f"the full batch's; use one of {sorted(PER_PAIR_DPO_LOSSES)} or fit_trainer(exact=False)"
        )
    return _count_pairs


def _window_items(trainer: Any, batches: list[Any], count: ItemCounter, device: Any) -> torch.Tensor:
    """N: the items of the window's micro-batches, summed over every rank."""
    local = sum((count(batch).to(torch.float64) for batch in batches), torch.zeros((), dtype=torch.float64))
    local = local.to(device)
    if int(getattr(trainer.args, "world_size", 1)) > 1:
        return trainer.accelerator.gather(local.reshape(1)).sum()  # type: ignore[no-any-return]
    return local


def check_exact_supported(trainer: Any) -> None:
    """Refuse what the weighting cannot keep exact, before changing anything on the trainer."""
    if int(getattr(trainer.args, "n_gpu", 1)) > 1:
        raise ConfigError(
            "exact loss weighting does not support torch.nn.DataParallel (n_gpu > 1): launch one process "
            "per GPU with torchrun or accelerate launch instead"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ConfigError(
            "the Trainer has a compute_loss_func: it already weights the loss with num_items_in_batch; "
            "pass exact=False to fit_trainer to keep it, or remove it to let microbatch weight the model's "
            "loss"
        )
    _trainer_counter(trainer)  # refuses a preference loss that is no mean over pairs


def exact_loss_weighting(trainer: Any, *, count_items: ItemCounter | None = None) -> str:
    """Make ``trainer``'s accumulation exact: weight each micro-batch's mean loss by n / N * W.

    ``count_items(batch)`` counts the items of a collated batch the loss averages over (default:
    ``count_items_rule(trainer.model)``). Changes ``trainer.model_accepts_loss_kwargs`` (False: the
    model returns its plain mean), ``trainer.loss_is_scaled_for_ga`` (True) and replaces the
    instance's ``compute_loss`` and ``_get_num_items_in_batch``. Returns the sentence it logs.
    """
    check_exact_supported(trainer)
    count = count_items or _trainer_counter(trainer)
    world_size = int(getattr(trainer.args, "world_size", 1))
    compute_loss = trainer.compute_loss  # the class's (TRL's SFTTrainer has its own)

    def get_num_items_in_batch(batch_samples: list[Any], device: Any) -> torch.Tensor | None:
        return _window_items(trainer, batch_samples, count, device) if batch_samples else None

    def weighted_compute_loss(
        model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if num_items_in_batch is None or not model.training:
            return compute_loss(model, inputs, return_outputs=return_outputs)  # evaluation: the plain mean
        items = count(inputs)
        result = compute_loss(model, inputs, return_outputs=return_outputs)
        loss = result[0] if return_outputs else result
        # loss_micro * n / N * W; a micro-batch without items contributes zero (its mean is 0 / 0).
        weight = items.to(loss.device, torch.float64) * world_size / num_items_in_batch.to(loss.device)
        loss = torch.where(items.to(loss.device) > 0, loss, torch.zeros_like(loss)) * weight.to(loss.dtype)
        return (loss, *result[1:]) if return_outputs else loss

    trainer.model_accepts_loss_kwargs = False
    trainer.loss_is_scaled_for_ga = True
    trainer.compute_loss = weighted_compute_loss
    trainer._get_num_items_in_batch = get_num_items_in_batch
    items = "count_items" if count_items is not None else _describe(trainer)
    note = (
        "microbatch weights the Trainer's loss: each micro-batch's mean x its items / the window's items "
        f"across {world_size} rank(s) (items: {items}); the model is no longer given num_items_in_batch"
    )
    logger.warning("fit_trainer: %s", note)
    return note


def count_is_pairs(trainer: Any) -> bool:
    return type(trainer).__name__ == "DPOTrainer"


def _describe(trainer: Any) -> str:
    if count_is_pairs(trainer):
        return "preference pairs"
    if _shifts_labels(trainer.model):
        return "shifted labels != -100"
    return "labels != -100"
