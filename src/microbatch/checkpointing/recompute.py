"""Running one checkpointed block: the recompute's safety guards and the call into torch's checkpoint.

- RunningStatsGuard: the recompute updates scratch copies of BatchNorm / InstanceNorm running
  statistics, so the real ones are updated exactly once per training forward (pytorch #96136).
- cache_disabler: a block called with ``use_cache=True`` or a past-key-values argument runs with the
  cache off, so a recompute cannot write a KV cache twice.
- run_checkpointed: torch's non-reentrant checkpoint (RNG state preserved) with the guard around
  the recompute, the selective plan's contexts, and the offload hooks around the block's inputs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .selective import OpKey, SelectivePlan

__all__ = [
    "NORMS_WITH_RUNNING_STATS",
    "RunningStatsGuard",
    "cache_disabler",
    "failed_block",
    "run_checkpointed",
]

NORMS_WITH_RUNNING_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
# Argument names through which a block receives a cache it would write into.
_CACHE_SWITCHES = ("use_cache",)
_CACHE_OBJECTS = (
    "past_key_values",
    "past_key_value",
    "layer_past",
    "kv_cache",
    "cache",
)  # "cache": transformers 5
# Set on an exception raised inside a checkpointed block's forward or recompute: the block's name.
_FAILED_BLOCK = "microbatch_checkpointed_block"


def failed_block(error: BaseException) -> str | None:
    """The checkpointed block ``error`` was raised in (innermost), or None when none was running."""
    return getattr(error, _FAILED_BLOCK, None)


def _name_block(error: BaseException, block: str) -> None:
    if block and failed_block(error) is None:
        with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__
            setattr(error, _FAILED_BLOCK, block)


class RunningStatsGuard:
    """Lets a recompute update scratch copies of the running statistics instead of the real ones.

    In training mode a BatchNorm's output uses the batch's own statistics, so the recompute's output
    does not depend on the running buffers; only their second in-place update must not land. The
    recompute runs inside torch's checkpoint (and selective-checkpoint dispatch modes), where extra
    tensor ops are not allowed, so the scratch buffers are made beforehand (``prepare``, outside the
    checkpoint) and the recompute only swaps module attributes. Cost: one copy of the norms' buffers.
    """

    def __init__(self, norms: Sequence[nn.Module]) -> None:
        self.norms = list(norms)
        self.scratch: dict[tuple[int, str], torch.Tensor] = {}

    def _updating(self) -> list[nn.Module]:
        return [m for m in self.norms if m.training and getattr(m, "track_running_stats", False)]

    def prepare(self) -> None:
        for module in self._updating():
            for name, buffer in module.named_buffers(recurse=False):
                key = (id(module), name)
                known = self.scratch.get(key)
                if known is None or (known.shape, known.dtype, known.device) != (
                    buffer.shape,
                    buffer.dtype,
                    buffer.device,
                ):
                    self.scratch[key] = buffer.detach().clone()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        originals: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for module in self._updating():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    scratch = self.scratch.get((id(module), name))
                    if scratch is not None:
                        originals.append((module, name, buffer))
                        setattr(module, name, scratch)
            yield
        finally:
            for module, name, buffer in originals:
                setattr(module, name, buffer)


def cache_disabler(
    forward: Callable[..., Any], notice: Callable[[], None]
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    """A function that turns the cache arguments of ``forward`` off: use_cache=False, caches None."""
    positions: dict[str, int] = {}
    with contextlib.suppress(TypeError, ValueError):
        for index, parameter in enumerate(inspect.signature(forward).parameters.values()):
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                positions[parameter.name] = index

    def is_on(value: Any) -> bool:  # identity tests: a cache may be a tensor, whose == is elementwise
        return value is not None and value is not False

    def disable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        changed = False
        new_args, new_kwargs = list(args), dict(kwargs)
        for name in (*_CACHE_SWITCHES, *_CACHE_OBJECTS):
            off = False if name in _CACHE_SWITCHES else None
            if name in new_kwargs:
                if is_on(new_kwargs[name]):
                    new_kwargs[name], changed = off, True
            elif positions.get(name, len(new_args)) < len(new_args) and is_on(new_args[positions[name]]):
                new_args[positions[name]], changed = off, True
        if not changed:
            return args, kwargs
        notice()
        return tuple(new_args), new_kwargs

    return disable


def run_checkpointed(
    forward: Callable[..., Any],
    saving: Callable[[], AbstractContextManager[Any]],
    guard: RunningStatsGuard | None,
    plan: SelectivePlan | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    block: str = "",
) -> Any:
    """Call ``forward`` under torch's non-reentrant checkpoint; ``saving()`` is the context kept
    around the block's inputs (the offload hooks, or a null context). An exception raised in the
    forward or the recompute carries ``block``'s name (``failed_block``)."""
    # Keyword arguments travel positionally so that torch saves their tensors with the other
    # inputs (through the offload hooks, when offloading) and no name can clash with checkpoint's.
    num_args, keyword_names = len(args), list(kwargs)
    calls = 0

    def run(*inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        call_args, call_kwargs = inputs[:num_args], dict(zip(keyword_names, inputs[num_args:], strict=True))
        try:
            if calls == 1:
                return forward(*call_args, **call_kwargs)
            # a recompute, inside backward; it may end early by an exception (torch's early stop)
            with guard.swapped() if guard is not None else contextlib.nullcontext():
                return forward(*call_args, **call_kwargs)
        except Exception as error:
            _name_block(error, block)
            raise
        finally:
            if plan is not None and calls > 1:
                plan.learn(saved, reached)

    if guard is not None:
        guard.prepare()

    saved: set[OpKey] = set()
    reached: set[OpKey] = set()
    # context_fn only when selective: an explicit noop_context_fn is not traceable by dynamo
    options: dict[str, Any] = {}
    if plan is not None:
        options["context_fn"] = functools.partial(plan.contexts, saved, reached)
    with saving():
        return torch_checkpoint.checkpoint(
            run,
            *args,
            *kwargs.values(),
            use_reentrant=False,
            preserve_rng_state=True,
            **options,
        )
