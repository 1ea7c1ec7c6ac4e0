"""Putting a model back exactly as it was after profiling it, without a second copy on its device.

The planner profiles and trials the model itself (no ``deepcopy``: a copy on the device charges
the parameters twice, and a model above half the device could not be planned). What a trial
changes is saved first, off the model's device:

- a model on an accelerator: in host memory;
- a model in host memory: in a temporary file, read back one tensor at a time, so host memory
  holds at most one tensor beyond the model while restoring.

Saved: trainable parameters, all buffers, the ``.grad`` of every parameter (the tensors
themselves, which nothing here writes in place), the train/eval mode of every module, an
optimizer's state (tensors saved like parameters, other entries copied), and the RNG of the CPU
and of every CUDA device the model uses. Frozen parameters are not saved: no optimizer updates a
parameter without a gradient.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


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
            handle, self._path = tempfile.mkstemp(prefix="microbatch-stash-", suffix=".pt")
            os.close(handle)
            # torch.save writes each storage's bytes; nothing is duplicated in host memory.
            torch.save([t.detach() for t in tensors], self._path)
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
