"""Decisions made once under torchrun: rank 0 decides, every rank gets the result (or the error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import distributed
from ..errors import ConfigError, MicrobatchError

_T = TypeVar("_T")


def on_rank_zero(decide: Callable[[], _T]) -> _T:
    """``decide()`` on rank 0 and its result on every rank; its error, if any, raised on every rank.

    Under torchrun, choices that must agree (the run folder's name, the plan) are made once: the
    other ranks neither profile nor plan, they receive rank 0's result by broadcast_object_list.
    """
    if distributed.world_size() == 1:
        return decide()
    payload: list[Any] = [None]
    error: MicrobatchError | None = None
    if distributed.is_rank_zero():
        try:
            payload[0] = ("result", decide())
        except MicrobatchError as raised:
            error, payload[0] = raised, ("error", str(raised))
    torch.distributed.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    kind, value = payload[0]
    if kind == "error":
        raise ConfigError(f"rank 0 stopped: {value}")
    result: _T = value
    return result
