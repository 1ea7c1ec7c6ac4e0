"""trees.batches: every walk of a batch goes through torch.utils._pytree (plus Mappings it does not know)."""

from __future__ import annotations

import collections
from collections import UserDict

import pytest
import torch

from microbatch.errors import ConfigError
from microbatch.trees.batches import (
    batch_size_of,
    map_tensors,
    move_batch,
    op_tensors,
    slice_batch,
    split_batch,
    tensor_bytes,
    tensors_of,
    tensors_with_paths,
)

Pair = collections.namedtuple("Pair", "ids mask")


class Encoding(UserDict):  # type: ignore[type-arg]
    """Like transformers' BatchEncoding: a Mapping that is not a dict, unknown to pytree."""


def _batch() -> dict[str, object]:
    return {
        "ids": torch.arange(12).view(6, 2),
        "pair": Pair(torch.ones(6, 3), torch.zeros(6, dtype=torch.bool)),
        "extra": [torch.full((6,), 2.0), "a string", 7],
        "encoding": Encoding({"labels": torch.arange(6)}),
    }


def test_every_tensor_is_found_in_order_with_its_path() -> None:
    paths = [path for path, _ in tensors_with_paths(_batch())]
    assert paths == [
        "batch['ids']",
        "batch['pair'].ids",
        "batch['pair'].mask",
        "batch['extra'][0]",
        "batch['encoding']['labels']",
    ]
    assert [t.shape for t in tensors_of(_batch())] == [t.shape for _, t in tensors_with_paths(_batch())]
    assert batch_size_of(_batch()) == 6
    assert tensor_bytes(_batch()) == 12 * 8 + 18 * 4 + 6 * 1 + 6 * 4 + 6 * 8


def test_slices_and_splits_keep_every_container_type() -> None:
    pieces = split_batch(_batch(), [4, 2])
    for piece, rows, start in zip(pieces, (4, 2), (0, 4), strict=True):
        assert isinstance(piece["pair"], Pair) and isinstance(piece["encoding"], Encoding)
        assert piece["extra"][1:] == ["a string", 7]  # non-tensors pass through
        assert torch.equal(piece["ids"], torch.arange(12).view(6, 2)[start : start + rows])
        assert torch.equal(piece["encoding"]["labels"], torch.arange(start, start + rows))
    assert slice_batch(_batch(), 1, 3)["pair"].ids.shape == (2, 3)
    with pytest.raises(ConfigError, match="add up to the batch size 6"):
        split_batch(_batch(), [4, 4])


def test_map_and_move_touch_tensors_only() -> None:
    doubled = map_tensors(lambda t: t * 2, _batch())
    assert torch.equal(doubled["pair"].ids, torch.full((6, 3), 2.0))
    moved = move_batch(_batch(), "meta")
    assert all(t.device.type == "meta" for t in tensors_of(moved))
    assert moved["extra"][2] == 7


def test_op_arguments_are_walked_like_batches() -> None:
    args = (torch.ones(2), [torch.zeros(1), 3], {"out": torch.ones(4)}, None)
    assert [t.numel() for t in op_tensors(args)] == [t.numel() for t in tensors_of(args)] == [2, 1, 4]
