"""Causal language models in the transformers convention: exact token-level accumulation.

A transformers causal LM shifts its labels inside ``forward``: the logits at position t predict
``labels[..., t + 1]``. Its loss (``ForCausalLMLoss`` in transformers/loss/loss_utils.py) pads the
labels with -100 on the right, keeps ``labels[..., 1:]`` and averages the cross entropy over the
positions whose shifted label is not -100:

    loss_i = sum_{t in S_i} CE_t / n_i,        n_i = |S_i| = #(labels_i[..., 1:] != -100)

for micro-batch i. The full batch's loss is the mean over every counted token of the window,
sum_i n_i loss_i / sum_i n_i, so ``Accumulator.backward(loss_i, items=n_i)`` reproduces its
gradient exactly. Two common mistakes differ from it when sequences have different lengths:

- dividing each micro-batch's mean by the number of micro-batches weighs a micro-batch of three
  tokens like one of three thousand (transformers #14638, fixed in the Trainer by #34191 in
  October 2024, and still wrong for models whose forward ignores ``num_items_in_batch``, #37766);
- counting ``labels != -100`` before the shift counts, per sequence, the first label, which no
  logit predicts (transformers #46204).

microbatch needs neither ``num_items_in_batch`` nor the window's total ahead of time: the model
returns its own token mean, ``causal_lm_loss`` returns the shifted count with it, and the
Accumulator divides once by the window's total at ``step()``. So it works for every model whose
loss is that mean, whether or not its forward takes ``num_items_in_batch``.

Batches are dicts as transformers' data collators make them: ``input_ids``, ``attention_mask``
and ``labels`` (``labels`` defaults to ``input_ids`` with -100 where ``attention_mask`` is 0).

Nothing here imports transformers: any model with transformers' calling convention works.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError, WorkloadError
from ..trees.batches import batch_size_of
from ..workload import OptimizerFactory, Workload

logger = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "causal_lm_loss",
    "causal_lm_workload",
    "check_causal_lm_loss",
    "count_causal_lm_items",
    "pad_causal_lm_batch",
]

IGNORE_INDEX = -100
# Keys a batch may carry that are not model inputs: the Trainer's window count is replaced by ours.
_NOT_MODEL_INPUTS = ("num_items_in_batch",)

BatchSource = Callable[[int], Any] | Mapping[str, torch.Tensor] | Sequence[Sequence[int] | torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Counting and batches


def count_causal_lm_items(
    labels: torch.Tensor, *, shifted: bool = False, ignore_index: int = IGNORE_INDEX
) -> int:
    """Tokens a causal LM's mean loss averages over: ``labels[..., 1:] != ignore_index``.

    ``shifted=True`` when ``labels`` are already shifted (transformers' ``shift_labels``), so every
    position that is not ``ignore_index`` counts.
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() < 1:
        raise ConfigError("labels must be a tensor of token ids with at least one dimension")
    predicted = labels if shifted else labels[..., 1:]
    return int((predicted != ignore_index).sum())


def pad_causal_lm_batch(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    *,
    pad_token_id: int = 0,
    max_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad token sequences into ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding).

    Sequences longer than ``max_length`` are cut; with ``max_length`` every row is padded to it (a
    fixed shape, as the planner wants), otherwise to the longest sequence.
    """
    if len(sequences) == 0:
        raise ConfigError("sequences is empty: pass at least one sequence of token ids")
    if max_length is not None and max_length < 2:
        raise ConfigError(f"max_length must be >= 2 (one input and one predicted token), got {max_length}")
    rows = [torch.as_tensor(s, dtype=torch.long).flatten()[:max_length] for s in sequences]
    width = max_length if max_length is not None else max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = row
        attention_mask[index, : len(row)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _labels_of(batch: Mapping[str, Any]) -> torch.Tensor:
    labels = batch.get("labels")
    if labels is not None:
        return labels  # type: ignore[no-any-return]
    input_ids, attention_mask = batch.get("input_ids"), batch.get("attention_mask")
    if input_ids is None:
        raise WorkloadError(
            "a causal LM batch needs 'labels' or 'input_ids' (a dict as transformers' collators make)"
        )
    if attention_mask is None:
        return input_ids  # type: ignore[no-any-return]
    return input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------
# The loss


def _accepts_use_cache(model: nn.Module) -> bool:
    """``use_cache`` is a parameter of forward, or forward takes ``**kwargs`` (a PEFT wrapper passes them
    on) and the model's config has ``use_cache``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "use_cache" in parameters:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return takes_kwargs and hasattr(getattr(model, "config", None), "use_cache")


def causal_lm_loss(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's own token-mean loss, the number of tokens it averages over, a tensor) for one batch.

    Calls ``model(**batch, labels=labels)`` without ``num_items_in_batch`` (so the loss is the
    micro-batch's mean) and with ``use_cache=False`` (a training forward never reads a cache).
    """
    if not isinstance(batch, Mapping):
        raise WorkloadError(
            f"a causal LM batch must be a dict of tensors (input_ids, attention_mask, labels), "
            f"got {type(batch).__name__}"
        )
    labels = _labels_of(batch)
    shift_labels = batch.get("shift_labels")
    # The count stays on the device (no host sync per micro-batch). A micro-batch with no predicted
    # token has a 0/0 loss: the Accumulator refuses it when the window ends, with both read at once.
    counted = shift_labels if shift_labels is not None else labels[..., 1:]
    items = (counted != IGNORE_INDEX).sum()
    inputs = {key: value for key, value in batch.items() if key not in _NOT_MODEL_INPUTS}
    inputs["labels"] = labels
    if _accepts_use_cache(model):
        inputs["use_cache"] = False
    output = model(**inputs)
    loss = output["loss"] if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]  # return_dict=False: the loss comes first
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise WorkloadError(
            f"{type(model).__name__}(**batch, labels=...) returned no scalar loss; causal_lm_workload "
            "needs a model that computes its loss from labels (a ...ForCausalLM class)"
        )
    return loss, items


def check_causal_lm_loss(model: nn.Module, *, vocab_size: int | None = None, seed: int = 0) -> None:
    """Raise WorkloadError unless ``model.loss_function`` is the mean over shifted labels != -100.

    Runs the model's loss function (not the model) on small random logits with random padding and
    compares it with that mean, so it costs nothing however large the model is. Models without a
    ``loss_function`` attribute (older transformers, custom models) are not checked.
    """
    loss_function = getattr(model, "loss_function", None)
    config = getattr(model, "config", None)
    vocab = vocab_size if vocab_size is not None else getattr(config, "vocab_size", None)
    if not callable(loss_function) or not isinstance(vocab, int):
        logger.info(
            "%s has no loss_function and vocab_size to check; trusting that its loss is the mean over "
            "shifted labels != -100",
            type(model).__name__,
        )
        return
    generator = torch.Generator().manual_seed(seed)
    num_rows, length = 3, 7
    logits = torch.randn(num_rows, length, vocab, generator=generator)
    labels = torch.randint(0, vocab, (num_rows, length), generator=generator)
    labels[0, 4:] = IGNORE_INDEX  # right padding
    labels[1, :2] = IGNORE_INDEX  # a masked prompt
    with torch.no_grad():
        try:
            actual = float(loss_function(logits, labels, vocab_size=vocab))
        except (TypeError, ValueError, RuntimeError) as error:
            raise WorkloadError(
                f"{type(model).__name__}.loss_function(logits, labels, vocab_size=...) fails ({error}); "
                "causal_lm_workload needs a causal language model (a ...ForCausalLM class)"
            ) from error
        shifted = labels[:, 1:]
        expected = float(
            F.cross_entropy(
                logits[:, :-1].reshape(-1, vocab).double(),
                shifted.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        ) / count_causal_lm_items(labels)
    # Both are means of the same cross entropies, in float32 or better: they agree to ~1e-6.
    if not math.isclose(actual, expected, rel_tol=1e-4):
        raise WorkloadError(
            f"{type(model).__name__}.loss_function is not the mean cross entropy over shifted labels != -100 "
            f"(on a probe: {actual:.6g}, expected {expected:.6g}), so counting those labels as items would "
            "weigh micro-batches wrongly. Build the Workload yourself with a loss that returns "
            "(mean loss, the count it averages over)"
        )


# --------------------------------------------------------------------------------------------------
# Workloads


class _Rows:
    """``make_batch(b)`` over a padded dataset (a dict of tensors): the next b rows, cycling."""

    def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
        self.data = dict(data)
        self.num_rows = batch_size_of(self.data)
        self.position = 0

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        index = (self.position + torch.arange(batch_size)) % self.num_rows
        self.position = (self.position + batch_size) % self.num_rows
        return {
            key: value[index] if isinstance(value, torch.Tensor) else value
            for key, value in self.data.items()
        }


class _Sequences:
    """``make_batch(b)`` over variable-length token sequences: the next b, cycling, right-padded."""

    def __init__(
        self, sequences: Sequence[Sequence[int] | torch.Tensor], *, pad_token_id: int, max_length: int | None
    ) -> None:
        self.sequences = list(sequences)
        self.pad_token_id, self.max_length = pad_token_id, max_length
        self.position = 0

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        chosen = [self.sequences[(self.position + i) % len(self.sequences)] for i in range(batch_size)]
        self.position = (self.position + batch_size) % len(self.sequences)
        return pad_causal_lm_batch(chosen, pad_token_id=self.pad_token_id, max_length=self.max_length)


def _make_batch_from(
    batches: BatchSource, *, pad_token_id: int, max_length: int | None
) -> Callable[[int], Any]:
    if isinstance(batches, Mapping):
        if "input_ids" not in batches and "labels" not in batches:
            raise ConfigError(
                "batches as a dict must hold 'input_ids' (and 'attention_mask', 'labels') with one row "
                f"per sequence; it has {sorted(batches)}"
            )
        return _Rows(batches)
    if callable(batches):
        return batches
    if isinstance(batches, Sequence) and not isinstance(batches, (str, bytes)):
        if len(batches) == 0:
            raise ConfigError("batches is an empty sequence: pass token sequences, a dict or make_batch(b)")
        return _Sequences(batches, pad_token_id=pad_token_id, max_length=max_length)
    raise ConfigError(
        "batches must be make_batch(b) -> dict, a dict of padded tensors (one row per sequence), or a "
        f"list of token-id sequences; got {type(batches).__name__}"
    )


def causal_lm_workload(
    model: nn.Module,
    batches: BatchSource,
    *,
    name: str = "hf-causal-lm",
    description: str = "",
    optimizer: OptimizerFactory | None = None,
    pad_token_id: int | None = None,
    max_length: int | None = None,
    check_loss: bool = True,
) -> Workload:
    """A Workload for a transformers causal LM: its own token-mean loss, counted exactly.

    ``batches`` is ``make_batch(b) -> dict`` (input_ids, attention_mask, labels), a dict of padded
    tensors with one row per sequence (rows are handed out in order, cycling), or a list of token-id
    sequences (right-padded per batch with ``pad_token_id``, to ``max_length`` when given). The loss
    is ``causal_lm_loss``; ``check_loss`` first checks that the model's loss function is the mean
    over shifted labels (``check_causal_lm_loss``).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}"
        )
    if check_loss:
        check_causal_lm_loss(model)
    if pad_token_id is None:
        config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        pad_token_id = config_pad if isinstance(config_pad, int) else 0
    make_batch = _make_batch_from(batches, pad_token_id=pad_token_id, max_length=max_length)
    if not description:
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", type(model).__name__)
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        description = f"{kind} causal LM ({millions:.3g}M parameters), token-mean loss over shifted labels"
    return Workload(
        model=model,
        make_batch=make_batch,
        loss=causal_lm_loss,
        optimizer=optimizer,
        name=name,
        description=description,
    )
