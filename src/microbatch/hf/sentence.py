"""``CachedSentenceLoss``: any sentence-transformers in-batch-negatives loss at any batch, exactly.

A drop-in loss for SentenceTransformer training (``SentenceTransformerTrainer(loss=...)`` or
``model.fit``): ``CachedSentenceLoss(model, MultipleNegativesRankingLoss(model), micro_batch_size=16)``
computes the wrapped loss over the whole batch, so every sample keeps all the batch's negatives, while
the encoder sees ``micro_batch_size`` rows at a time, through ``microbatch.cached_backward``'s
gradient caching (``accumulate.cached.cached_representations``, one column at a time): encode every
micro-batch without a graph, the loss and its gradient at the embeddings, then re-encode each
micro-batch with its RNG state and backpropagate its slice.
The gradient is the full batch's (dropout included).

The wrapped loss must offer ``compute_loss_from_embeddings(embeddings, labels)`` (MNRL, GISTEmbed,
MultipleNegativesSymmetricRankingLoss and the others built on it do). Like sentence-transformers' own
cached losses, each micro-batch drops the padding columns none of its rows uses, so a micro-batch of
short sentences is encoded at its own width, not the batch's. ``max_tokens=`` instead of
``micro_batch_size=`` cuts each column into mini-batches of at most that many padded tokens (rows x
longest row, lengths from the attention mask), so an unlucky mini-batch of long documents cannot OOM
(sentence-transformers #3859); the loss and gradient are unchanged (accumulate/cached_tokens.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..accumulate.cached import cached_representations
from ..accumulate.cached_tokens import check_split
from ..errors import ConfigError

__all__ = ["CachedSentenceLoss", "trim_padding"]


def trim_padding(features: Mapping[str, Any]) -> dict[str, Any]:
    """``features`` without the trailing columns that no row's attention mask covers."""
    mask = features.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return dict(features)
    used = mask.bool().any(dim=0).nonzero()
    width = int(used.max()) + 1 if used.numel() else mask.shape[1]
    if width == mask.shape[1]:
        return dict(features)
    columns = mask.shape[1]

    def trimmed(value: Any) -> Any:
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == columns
        return value[:, :width] if per_token else value

    return {key: trimmed(value) for key, value in features.items()}


class CachedSentenceLoss(nn.Module):
    """``loss`` over the whole batch, the encoder run ``micro_batch_size`` rows (or ``max_tokens`` padded
    tokens) at a time (module doc)."""

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        *,
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if not callable(getattr(loss, "compute_loss_from_embeddings", None)):
            raise ConfigError(
                f"CachedSentenceLoss needs a loss with compute_loss_from_embeddings(embeddings, labels); "
                f"{type(loss).__name__} has none (wrap MultipleNegativesRankingLoss or a loss built on it)"
            )
        check_split(micro_batch_size, max_tokens, gather=False)
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ConfigError(f"max_tokens must be a positive int (padded tokens), got {max_tokens!r}")
        elif (
            isinstance(micro_batch_size, bool)
            or not isinstance(micro_batch_size, int)
            or micro_batch_size < 1
        ):
            raise ConfigError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
        self.model = model
        self.loss = loss
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens

    def _encode(self, features: dict[str, Any]) -> torch.Tensor:
        return self.model(trim_padding(features))["sentence_embedding"]  # type: ignore[no-any-return]

    def forward(
        self, sentence_features: Iterable[dict[str, torch.Tensor]], labels: torch.Tensor | None
    ) -> Any:
        columns = [dict(features) for features in sentence_features]
        if not columns:
            raise ConfigError("CachedSentenceLoss got no sentence features (a batch of no columns)")
        # One column at a time (anchors, then positives, ...), as sentence-transformers' CachedMNRL:
        # only one column's micro-batch of activations is alive in the re-encode, not all columns'.
        embeddings = [
            cached_representations(
                self._encode,
                features,
                micro_batch_size=self.micro_batch_size,
                gather=False,
                max_tokens=self.max_tokens,
            )
            for features in columns
        ]
        value = self.loss.compute_loss_from_embeddings(embeddings, labels)  # type: ignore[operator]
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(f"{type(self.loss).__name__}.compute_loss_from_embeddings must return a scalar")
        return value

    def get_config_dict(self) -> dict[str, Any]:  # read by sentence-transformers' model card
        inner: dict[str, Any] = getattr(self.loss, "get_config_dict", dict)()
        split = {"micro_batch_size": self.micro_batch_size, "max_tokens": self.max_tokens}
        split = {key: value for key, value in split.items() if value is not None}
        return {**split, "loss": type(self.loss).__name__, **inner}
