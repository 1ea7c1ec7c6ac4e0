"""Who am I: rank, world size, starting and ending the process group, rank-0 logging."""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import os
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError

logger = logging.getLogger(__name__)

ParallelKind = Literal["ddp", "fsdp"]


# ---------------------------------------------------------------------- who am I


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# Set inside single_process(): this process measures its own model alone (the planner's profile and
# trial run on one rank while the others wait), so nothing may see the other ranks.
_SINGLE_PROCESS: contextvars.ContextVar[bool] = contextvars.ContextVar("single_process", default=False)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Inside (also as a decorator), world_size() is 1: no collective runs and no rank waits.

    The planner profiles and proves one rank's unwrapped model on rank 0 while the other ranks wait
    for the plan; an Accumulator built there must neither all-reduce nor warn that the model is not
    wrapped in DDP.
    """
    token = _SINGLE_PROCESS.set(True)
    try:
        yield
    finally:
        _SINGLE_PROCESS.reset(token)


def world_size() -> int:
    if _SINGLE_PROCESS.get():
        return 1
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def is_rank_zero() -> bool:
    return rank() == 0


def _env_int(name: str, default: int, *, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name} must be >= {minimum}, got {value}")
    return value


def world_size_from_env() -> int:
    """Number of data-parallel processes of this launch, known before any process group exists.

    Under torchrun this is ``WORLD_SIZE`` (set for every worker); otherwise 1. The planner and the
    CLI use it so the effective batch is micro-batch x steps x world size.
    """
    if is_initialized():
        return world_size()
    return _env_int("WORLD_SIZE", 1, minimum=1)


def local_rank() -> int:
    """This process's index on its machine (torchrun's ``LOCAL_RANK``), 0 when not launched so."""
    return _env_int("LOCAL_RANK", 0, minimum=0)


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun (or anything that sets the same env:// variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(*, backend: str | None = None, timeout_s: float = 1800.0) -> torch.device:
    """Join the process group torchrun describes and return the device this rank computes on.

    NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on the CPU; ``backend``
    overrides. Without torchrun's variables nothing is initialised (a single process). Calling it
    again once initialised only returns the device.
    """
    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    device = torch.device("cuda", local_rank()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if is_initialized() or not launched_by_torchrun():
        return device
    # NCCL for the gradients; gloo beside it for the control numbers (all_reduce_values).
    chosen = backend or ("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
    dist.init_process_group(
        backend=chosen,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if use_cuda else None,
    )
    log_rank_zero(logger, logging.INFO, "process group: %s, %d ranks", chosen, world_size())
    return device


def wrap_data_parallel(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel when more than one rank runs, else ``model`` itself.

    Give the returned module to the Accumulator (and its parameters to the optimizer): that is how
    the Accumulator sees DDP and skips the sync on all but each window's last micro-batch.
    """
    if world_size() <= 1:
        return model
    if device.type != "cuda":
        return nn.parallel.DistributedDataParallel(model)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nn.parallel.DistributedDataParallel(model, device_ids=[index])


# ---------------------------------------------------------------------- rank-0 logging


def log_rank_zero(log: logging.Logger, level: int, message: str, *args: object) -> None:
    """``log.log(level, message, *args)`` on rank 0 only (every rank says the same thing)."""
    if is_rank_zero():
        log.log(level, message, *args)


class RankZeroFilter(logging.Filter):
    """A filter for a handler (set up by an application, not by library code) that drops the
    records of every rank but 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank_zero()
