"""torch.distributed helpers: who am I, gradient sync per micro-batch, global counts, launching.

Data parallelism averages gradients over ranks: DDP's all-reduce and FSDP2's reduce-scatter both
divide the sum by the world size W. The Accumulator undoes that factor and divides by the global
item count instead, so the window gradient is sum over ranks and micro-batches of
items * grad(loss) / global_items: the gradient of the global batch's mean loss.

Gradient sync is switched per micro-batch, differently for the two wrappers:

- DDP decides in the *forward* whether the coming backward all-reduces (``no_sync()`` must cover
  the forward too), so the whole micro-batch runs inside ``ddp_sync``.
- FSDP2 reads its persistent ``set_requires_gradient_sync`` flag only in the post-backward hook,
  so ``fsdp_sync`` switches it off for the backward alone and sets it back to True in a
  ``finally``: whatever happens, the flag is True outside a non-last micro-batch's backward.

Every collective here runs on every rank at the same point of the loop, or it would hang.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .compiled import unwrap_compiled
from .errors import ConfigError

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


def destroy() -> None:
    """Leave the process group, if one was joined."""
    if is_initialized():
        _CONTROL_GROUPS.clear()
        dist.destroy_process_group()


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


# ---------------------------------------------------------------------- gradient sync


def data_parallel_kind(model: nn.Module) -> ParallelKind | None:
    """ "ddp" for DistributedDataParallel, "fsdp" for a model sharded with FSDP2's fully_shard, else None.

    A ``torch.compile``'d model is looked through: what it wraps decides.
    """
    model = unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch builds without FSDP2
        return None
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp"
    return None


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_fsdp_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Set FSDP2's persistent gradient-sync flag on every fully_shard module of ``model``."""
    for module in _fsdp_modules(model):
        module.set_requires_gradient_sync(enabled, recurse=False)  # type: ignore[operator]


@contextlib.contextmanager
def ddp_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Run a DDP micro-batch (forward and backward) with or without its gradient all-reduce.

    Disabled: ``model.no_sync()``. Enabled: sync is forced on, in case an abandoned loop left a
    ``no_sync`` open (the gradient would silently stay local). A no-op for other models.
    """
    model = unwrap_compiled(model)  # torch.compile(DDP(model)): the DDP module holds the sync flag
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        yield
        return
    if enabled:
        model.require_backward_grad_sync = True
        yield
        return
    with model.no_sync():
        yield


@contextlib.contextmanager
def fsdp_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Run one backward with or without FSDP2's reduce-scatter; the flag is True again on exit,
    also when the backward raises. A no-op for other models."""
    modules = _fsdp_modules(model) if data_parallel_kind(model) == "fsdp" else []
    if not modules:
        yield
        return
    for module in modules:
        module.set_requires_gradient_sync(enabled, recurse=False)  # type: ignore[operator]
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Synchronise gradients across ranks in this block (forward and backward) only when ``enabled``.

    For hand-written loops; the Accumulator applies ``ddp_sync`` and ``fsdp_sync`` itself.
    """
    with ddp_sync(model, enabled=enabled), fsdp_sync(model, enabled=enabled):
        yield


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


# ---------------------------------------------------------------------- launching (tests, benchmarks)


def _launched_main(
    rank_index: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_dir: str,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank_index),
            "LOCAL_RANK": str(rank_index),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"rank{rank_index}.pt")
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank_index, world_size=world, timeout=timeout)
        try:
            result: dict[str, Any] = {"result": fn(*args)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, path)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes in one process group; return the results.

    For tests and benchmarks: the processes are spawned, meet on 127.0.0.1 at a port the OS picks
    (a TCPStore held by this process, so no other program can take the port in between), get the
    env:// variables torchrun would set, and use one CPU thread each. ``fn`` must be importable
    (a module-level function; a script calling launch() needs the
    ``if __name__ == "__main__":`` guard) and its result picklable by ``torch.save``. If a rank raises, the
    others are stopped and a RuntimeError carries that rank's traceback; past ``timeout_s`` all are
    stopped and TimeoutError says which ranks were still running (a hang becomes a failure).
    """
    import multiprocessing

    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The parent serves the rendezvous store; port 0 asks the OS for a free port.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="microbatch-launch-") as result_dir:
        processes = [
            context.Process(
                target=_launched_main,
                args=(r, world_size, store.port, backend, timeout_s, fn, tuple(args), result_dir),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            _wait(processes, result_dir, timeout_s)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join(5.0)
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                code = processes[r].exitcode
                raise RuntimeError(f"rank {r} of {world_size} exited (code {code}) without a result")
            outcome = torch.load(path, weights_only=False)
            if "error" in outcome:
                raise RuntimeError(f"rank {r} of {world_size} failed:\n{outcome['error']}")
            results.append(outcome["result"])
    del store
    return results


def _wait(processes: Sequence[Any], result_dir: str, timeout_s: float) -> None:
    """Wait for every process; stop early when one has failed (the others may be stuck in a collective)."""
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, bool] = {}  # rank -> failed, for the ranks that have exited
    failed_at: float | None = None
    while any(p.is_alive() for p in processes):
        now = time.monotonic()
        if now > deadline:
            running = [r for r, p in enumerate(processes) if p.is_alive()]
            raise TimeoutError(f"ranks {running} still running after {timeout_s:g} s (a hang?); stopped them")
        for r, process in enumerate(processes):
            if r not in outcome and not process.is_alive():
                outcome[r] = _failed(process, os.path.join(result_dir, f"rank{r}.pt"))
                if outcome[r] and failed_at is None:
                    failed_at = now
        if failed_at is not None and now - failed_at > 5.0:
            return  # a rank failed 5 s ago: the caller stops the others, which may wait on it forever
        time.sleep(0.02)


def _failed(process: Any, path: str) -> bool:
    if process.exitcode != 0 or not os.path.exists(path):
        return True
    return "error" in torch.load(path, weights_only=False)
