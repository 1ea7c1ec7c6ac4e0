"""Batches as nested tensors: how big one is, and how to cut one into micro-batches.

A batch is a tensor, or any nesting that torch.utils._pytree walks (tuples, namedtuples, lists,
dicts, and types registered with it) plus any other Mapping (transformers' BatchEncoding), whose
tensors share their first dimension: the sample dimension. Anything that is not a tensor is passed
through unchanged. Every walk of a batch in microbatch goes through the functions here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError


def _is_foreign_mapping(node: Any) -> bool:
    """A Mapping pytree does not know (transformers' BatchEncoding, a UserDict): walked here."""
    return isinstance(node, Mapping) and type(node) not in pytree.SUPPORTED_NODES


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) batch, depth first in the order pytree flattens it."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(batch, is_leaf=_is_foreign_mapping):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_foreign_mapping(leaf):
            found += tensors_of(list(leaf.values()))
    return found


def tensors_with_paths(batch: Any, root: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for each tensor of a batch, paths as code reads them: ``batch['ids']``, ``batch[0]``."""
    found: list[tuple[str, torch.Tensor]] = []
    leaves, _ = pytree.tree_flatten_with_path(batch, is_leaf=_is_foreign_mapping)
    for path, leaf in leaves:
        where = root + pytree.keystr(path)
        if isinstance(leaf, torch.Tensor):
            found.append((where, leaf))
        elif _is_foreign_mapping(leaf):
            for key, value in leaf.items():
                found += tensors_with_paths(value, f"{where}[{key!r}]")
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """The batch with ``fn`` applied to every tensor; containers (namedtuples too) keep their types."""

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if _is_foreign_mapping(leaf):
            return type(leaf)({key: map_tensors(fn, value) for key, value in leaf.items()})
        return leaf

    return pytree.tree_map(visit, batch, is_leaf=_is_foreign_mapping)


def op_tensors(args: Any) -> list[torch.Tensor]:
    """The tensors in an aten op's arguments or outputs (tuples, lists, dicts of them).

    The hot path of the dispatch modes that see every op (MemoryTracker, the roofline), walked by
    hand: pytree's general walk costs 2.5x here (measured on a 5-argument tuple).
    """
    if isinstance(args, torch.Tensor):
        return [args]
    if isinstance(args, (list, tuple)):
        return [t for item in args for t in op_tensors(item)]
    if isinstance(args, dict):
        return [t for item in args.values() for t in op_tensors(item)]
    return []


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor found in a (nested) batch, depth first; None when there is none."""
    tensors = tensors_of(batch)
    return tensors[0] if tensors else None


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors of a batch (each tensor's own elements, shared storages counted again)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(batch))


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise ConfigError(
            "cannot tell the batch size of a batch without a tensor of at least one dimension; "
            "pass items= to Accumulator.backward() explicitly"
        )
    return int(tensor.shape[0])


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of every tensor in a (nested) batch."""
    return map_tensors(lambda tensor: tensor[start:stop], batch)


def micro_batch_sizes(total: int, micro_batch_size: int) -> list[int]:
    """Cut ``total`` samples into micro-batches of ``micro_batch_size``; the last may be shorter."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    full, rest = divmod(total, micro_batch_size)
    return [micro_batch_size] * full + ([rest] if rest else [])


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a batch into consecutive micro-batches with the given sample counts."""
    total = batch_size_of(batch)
    if sum(sizes) != total or any(size < 1 for size in sizes):
        raise ConfigError(
            f"micro-batch sizes {list(sizes)} must be positive and add up to the batch size {total}"
        )
    pieces, start = [], 0
    for size in sizes:
        pieces.append(slice_batch(batch, start, start + size))
        start += size
    return pieces


def move_batch(batch: Any, device: torch.device | str) -> Any:
    """The batch with every tensor moved to ``device``."""
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)
