"""Gradient caching by tokens: ``cached_backward``'s mini-batches cut by padded tokens, not rows.

A fixed ``micro_batch_size`` bounds the rows of an encode pass, not its activations: on long-tailed
data (chat turns of 20 tokens beside documents of 2,000) one unlucky mini-batch of long rows costs
many times the average and sets the run's peak (sentence-transformers #3859). With ``max_tokens``
the batch's rows are cut by ``split_by_tokens`` (accumulate/tokens.py: longest first, the fewest
mini-batches, then the fewest padded tokens) into mini-batches of ``rows x longest <= max_tokens``.

Why the loss and the gradient are unchanged. Gradient caching splits the gradient at the
representations (accumulate/cached.py):

    dL/dtheta = sum_j (dr_j/dtheta)^T (dL/dr_j)        j: mini-batches, any partition of the rows

Cutting by tokens only picks another partition, and orders the rows longest first. The encoded
representations come back in that order, and ``restore_order`` puts them back in the batch's order
with an index (r = r_sorted[inverse]) before the loss sees them; its backward scatters dL/dr to the
sorted rows, values moved, not combined. So the loss is computed on the same matrix as the unsplit
batch, and each row's encode gradient is that of the unsplit batch (given an encode whose row does
not depend on the other rows of its mini-batch: masked attention and pooling, no BatchNorm), summed
in another order: float64 rounding apart, the same.

Row lengths: ``lengths=`` (one int per row), or read from a mapping batch's 2-D ``attention_mask``
as the last attended column + 1 (right padding: the width a mini-batch trimmed of its unused
columns has). The mini-batches keep the batch's columns; ``encode`` drops the padding it does not
need (``hf.CachedSentenceLoss``'s does, with ``hf.sentence.trim_padding``), else the budget bounds
the rows only. One process only: data-parallel ranks would cut into different counts of mini-batches,
which DDP's paired forwards do not allow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..trees.batches import batch_size_of, map_tensors, micro_batch_sizes, split_batch
from .tokens import split_by_tokens

__all__ = ["TokenCut", "check_split", "cut_batch_by_tokens", "cut_for_cache", "restore_order", "row_lengths"]


@dataclass(frozen=True)
class TokenCut:
    """A batch cut by tokens: its mini-batches and the batch rows they hold, in encode order."""

    micro_batches: list[Any]
    groups: list[list[int]]  # batch row indices of each mini-batch
    lengths: list[int]  # every row's token count

    @property
    def order(self) -> list[int]:
        """Batch row index of each encoded row, mini-batch after mini-batch."""
        return [row for group in self.groups for row in group]

    def padded_tokens(self) -> list[int]:
        """Each mini-batch's rows x longest row."""
        return [len(group) * max(self.lengths[i] for i in group) for group in self.groups]


def row_lengths(batch: Any) -> list[int]:
    """Each row's token count from a mapping batch's 2-D ``attention_mask``: last attended column + 1."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ConfigError(
            "max_tokens= cuts the batch by its rows' token counts: pass lengths= (one int per row), or a "
            "dict batch with a 2-D 'attention_mask'"
        )
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask.bool() * columns).amax(dim=1).clamp(min=1)  # a row with no token counts as 1
    return [int(n) for n in last.tolist()]


def _rows(batch: Any, group: list[int]) -> Any:
    index = torch.tensor(group, dtype=torch.long)

    def select(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, index.to(tensor.device))

    return map_tensors(select, batch)


def cut_batch_by_tokens(batch: Any, max_tokens: int, *, lengths: Sequence[int] | None = None) -> TokenCut:
    """``batch``'s rows cut into mini-batches of at most ``max_tokens`` padded tokens (module doc)."""
    rows = batch_size_of(batch)
    values = row_lengths(batch) if lengths is None else list(lengths)
    if len(values) != rows:
        raise ConfigError(f"lengths has {len(values)} entries but the batch has {rows} rows: one per row")
    groups = split_by_tokens(values, max_tokens)  # validates max_tokens and the lengths
    micro_batches = [_rows(batch, group) for group in groups]
    return TokenCut(micro_batches=micro_batches, groups=groups, lengths=values)


def cut_for_cache(
    batch: Any, micro_batch_size: int | None, *, max_tokens: int | None, lengths: Sequence[int] | None
) -> tuple[list[Any], list[int] | None]:
    """cached_backward's mini-batches and, when cut by tokens, the batch row of each encoded row."""
    if max_tokens is None:
        if micro_batch_size is None:
            raise ConfigError("cached_backward: pass micro_batch_size= or max_tokens=")
        return split_batch(batch, micro_batch_sizes(batch_size_of(batch), micro_batch_size)), None
    cut = cut_batch_by_tokens(batch, max_tokens, lengths=lengths)
    return cut.micro_batches, cut.order


def restore_order(tensors: Sequence[torch.Tensor], order: Sequence[int] | None) -> list[torch.Tensor]:
    """Representations encoded in ``order`` (batch row of each) put back in the batch's row order."""
    if order is None or list(order) == sorted(order):
        return list(tensors)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(list(order), dtype=torch.long)] = torch.arange(len(order))
    return [t.index_select(0, inverse.to(t.device)) for t in tensors]


def check_split(micro_batch_size: object, max_tokens: object, *, gather: bool) -> None:
    """Exactly one of ``micro_batch_size`` (rows) and ``max_tokens`` (padded tokens); tokens: one process."""
    if (micro_batch_size is None) == (max_tokens is None):
        raise ConfigError(
            "cached_backward / CachedSentenceLoss: pass exactly one of micro_batch_size= (rows per encode "
            "pass) and max_tokens= (padded tokens per encode pass)"
        )
    if max_tokens is not None and gather:
        raise ConfigError(
            "max_tokens= runs on one process: ranks would cut their batches into different numbers of "
            "mini-batches; pass micro_batch_size= under torchrun, or gather=False"
        )
