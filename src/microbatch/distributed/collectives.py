"""Small collectives for control numbers (counts, flags, maxima).

Every collective here runs on every rank at the same point of the loop, or it would hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .process import is_initialized, rank, world_size

logger = logging.getLogger(__name__)

ParallelKind = Literal["ddp", "fsdp"]

_T = TypeVar("_T")


# ---------------------------------------------------------------------- small collectives


# The gloo group that carries control numbers beside an NCCL-only default group, by default group.
_CONTROL_GROUPS: dict[int, Any] = {}


def _control_group() -> Any | None:
    """The group for control numbers, on CPU tensors so that no device work is waited for.

    None (the default group) when that serves CPU tensors (gloo, or "cpu:gloo,cuda:nccl");
    otherwise a gloo group over the same ranks, made at the first call. Every caller is itself a
    collective that all ranks reach in the same order, which new_group requires.
    """
    if "gloo" in dist.get_backend_config():
        return None
    key = id(dist.group.WORLD)
    if key not in _CONTROL_GROUPS:
        _CONTROL_GROUPS[key] = dist.new_group(backend="gloo")
    return _CONTROL_GROUPS[key]


def all_reduce_values(values: Sequence[float], *, op: Literal["sum", "max"] = "sum") -> list[float]:
    """Sum (or max) a few numbers over all ranks in one float64 all_reduce; identity when not distributed.

    The numbers travel as a CPU tensor on a gloo group (_control_group), never through a device.
    float64 holds integer counts exactly up to 2**53, so global item counts stay exact.
    """
    if not is_initialized() or world_size() == 1:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(
        tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=_control_group()
    )
    return [float(v) for v in tensor.tolist()]


def all_reduce_max_(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise max over ranks, in place, on the tensor's own device and the default group
    (queued like any collective: the host does not wait). Identity when not distributed."""
    if is_initialized() and world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def agree_on_status(status: str | None, *, what: str) -> None:
    """Every rank says how its part went (None: fine, else its error); an error on any rank raises a
    ConfigError on every rank, naming the rank and its error. For checks that run before a collective
    and may fail on some ranks only (a batch shaped differently on one replica): without this, the
    ranks that passed would wait in the collective for the ones that raised. One all_gather of
    short strings on the control group; plain ``status`` check when not distributed."""
    statuses: list[Any] = [status]
    if is_initialized() and world_size() > 1:
        statuses = [None] * world_size()
        dist.all_gather_object(statuses, status, group=_control_group())
    failed = [(index, text) for index, text in enumerate(statuses) if text is not None]
    if not failed:
        return
    first, text = failed[0]
    others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    where = f"rank {first}{others}" if is_initialized() else "this process"
    raise ConfigError(f"{what} stopped on every rank: on {where}: {text}")


def decided_on_rank_zero(decide: Callable[[], _T], *, what: str) -> _T:
    """``decide()`` on rank 0 alone, its result (or its error) on every rank (plain ``decide()`` alone).

    For choices every rank must share that a rank could make differently on its own (a plan chosen
    from timings). The others wait in the broadcast; an error on rank 0 reaches them as a ConfigError
    naming ``what``, so no rank waits forever. The result travels pickled, on the control group.
    """
    if not is_initialized() or world_size() == 1:
        return decide()
    payload: list[Any] = [None]
    error: BaseException | None = None
    if rank() == 0:
        try:
            payload[0] = ("result", decide())
        except Exception as raised:  # every rank must hear of it, or the others wait forever
            error, payload[0] = raised, ("error", f"{type(raised).__name__}: {raised}")
    dist.broadcast_object_list(payload, src=0, group=_control_group())
    if error is not None:
        raise error
    kind, value = payload[0]
    if kind == "error":
        raise ConfigError(f"rank 0 stopped {what}: {value}")
    result: _T = value
    return result


def destroy() -> None:
    """Leave the process group, if one was joined, and forget the control groups made on it."""
    if is_initialized():
        _CONTROL_GROUPS.clear()
        dist.destroy_process_group()
