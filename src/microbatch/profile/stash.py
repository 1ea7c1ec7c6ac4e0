"""Putting a model back exactly as it was after profiling it, without a second copy on its device.

The planner profiles and trials the model itself (no ``deepcopy``: a copy on the device charges
the parameters twice, and a model above half the device could not be planned). What a trial
changes is saved first, off the model's device:

- a model on an accelerator: in host memory;
- a model in host memory: in a temporary file, read back one tensor at a time, so host memory
  holds at most one tensor beyond the model while restoring.

The temporary file is ``microbatch-stash-PID-*.pt`` in TMPDIR; it is removed on every exit path
Python sees (an exception, SIGINT, and SIGTERM / SIGHUP / SIGUSR1 / SIGUSR2 / SIGXCPU, which end
the process through SystemExit while it exists when they had their default action), and a file
left by a process that was killed outright (SIGKILL, a power cut) is removed by the next stash made
on the machine, or the next ``microbatch train`` / ``plan`` started, once its PID is no longer
running. A TMPDIR without room for the copy is an OSError (ENOSPC)
saying so before anything is written.

Saved: trainable parameters, all buffers, the ``.grad`` of every parameter (the tensors
themselves, which nothing here writes in place), the train/eval mode of every module, an
optimizer's state (tensors saved like parameters, other entries copied), and the RNG of the CPU
and of every CUDA device the model uses. Frozen parameters are not saved: no optimizer updates a
parameter without a gradient.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import glob
import logging
import os
import re
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

STASH_PREFIX = "microbatch-stash-"
_STASH_NAME = re.compile(rf"^{STASH_PREFIX}(\d+)-[^/]*\.pt$")
# Signals that end a process by default and are sent to end it politely (a terminal closing, kill).
# SIGUSR1 / SIGUSR2 (Slurm's and SGE's warnings before a kill) and SIGXCPU (a CPU-time limit) too:
# they end a process by default, so an unhandled one would leave the stash file behind.
_POLITE_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")
    if hasattr(signal, name)
)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_stale_stashes(directory: str | None = None) -> list[str]:
    """Remove stash files in ``directory`` (TMPDIR) whose process is gone; the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(directory or tempfile.gettempdir(), f"{STASH_PREFIX}*.pt")):
        match = _STASH_NAME.match(os.path.basename(path))
        if match and int(match.group(1)) != os.getpid() and not _process_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    if removed:
        logger.info("removed %d planner stash file(s) left by killed processes in TMPDIR", len(removed))
    return removed


def _check_room(directory: str, needed_bytes: int) -> None:
    try:
        info = os.statvfs(directory)
    except OSError:  # cannot tell: the write itself reports a full disk
        return
    free_bytes = info.f_bavail * info.f_frsize
    if free_bytes < needed_bytes:
        raise OSError(
            errno.ENOSPC,
            f"the temporary folder has {free_bytes:,} bytes free, the planner's copy of the model's "
            f"host tensors needs {needed_bytes:,}; free space there or set TMPDIR to a folder with room",
            directory,
        )


@contextlib.contextmanager
def polite_signals_exit() -> Iterator[None]:
    """SIGTERM / SIGHUP / SIGUSR1/2 / SIGXCPU raise SystemExit(128 + signal) inside the block (when
    they had their default action), so ``finally`` clauses run and the stash file is removed;
    restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {}
    for signum in _POLITE_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, leave)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _changeable_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    tensors.extend(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return tensors


class _Saved:
    """Copies of ``tensors`` off their device: host memory, or a temporary file for host tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._in_file = any(t.device.type == "cpu" for t in tensors)
        self._path: str | None = None
        self._copies: list[torch.Tensor] = []
        if self._in_file:
            remove_stale_stashes()
            directory = tempfile.gettempdir()
            _check_room(directory, sum(t.untyped_storage().nbytes() for t in tensors) + (1 << 20))
            handle, self._path = tempfile.mkstemp(prefix=f"{STASH_PREFIX}{os.getpid()}-", suffix=".pt")
            os.close(handle)
            try:
                # torch.save writes each storage's bytes; nothing is duplicated in host memory.
                torch.save([t.detach() for t in tensors], self._path)
            except BaseException as error:
                self.close()
                if isinstance(error, RuntimeError):  # torch.save hides the OSError (a full disk)
                    raise OSError(
                        errno.EIO,
                        f"cannot write the planner's temporary copy of the model ({error}); check that the "
                        "temporary folder has room, or set TMPDIR to one that does",
                        directory,
                    ) from error
                raise
        else:
            self._copies = [t.detach().to("cpu", copy=True) for t in tensors]

    def restore(self, tensors: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            if self._path is not None:
                loaded = torch.load(self._path, mmap=True, weights_only=True, map_location="cpu")
                for index, tensor in enumerate(tensors):
                    tensor.copy_(loaded[index])
                    loaded[index] = None  # one read-back tensor alive at a time
            else:
                for tensor, saved in zip(tensors, self._copies, strict=True):
                    tensor.copy_(saved)

    def close(self) -> None:
        self._copies = []
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None


def _optimizer_entries(optimizer: torch.optim.Optimizer | None) -> dict[Any, dict[str, Any]] | None:
    """Each parameter's state dict with its tensors as they are (restored in place) and the rest copied."""
    if optimizer is None:
        return None
    return {
        parameter: {
            key: value if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in state.items()
        }
        for parameter, state in optimizer.state.items()
    }


def _restore_optimizer(
    optimizer: torch.optim.Optimizer | None, entries: dict[Any, dict[str, Any]] | None
) -> None:
    if optimizer is None or entries is None:
        return
    optimizer.state.clear()
    for parameter, state in entries.items():
        optimizer.state[parameter] = dict(state)


def optimizer_instance(workload: Any) -> torch.optim.Optimizer | None:
    """The workload's optimizer when it is an instance (whose state a trial would change), else None."""
    optimizer = getattr(workload, "optimizer", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


@contextlib.contextmanager
def preserved(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """See the module docstring; the context manager behind profile.preserved_state."""
    tensors = _changeable_tensors(model, optimizer)
    grads = [(p, p.grad) for p in model.parameters()]
    modes = [(module, module.training) for module in model.modules()]
    entries = _optimizer_entries(optimizer)
    every = [*model.parameters(), *model.buffers()]
    devices = sorted({d.index or 0 for d in {t.device for t in every} if d.type == "cuda"})
    with polite_signals_exit():
        saved = _Saved(tensors)
        try:
            with torch.random.fork_rng(devices=devices):
                try:
                    yield
                finally:
                    saved.restore(tensors)
                    for parameter, grad in grads:
                        parameter.grad = grad
                    for module, training in modes:
                        module.training = training
                    _restore_optimizer(optimizer, entries)
        finally:
            saved.close()
