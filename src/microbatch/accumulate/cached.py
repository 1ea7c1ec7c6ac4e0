"""Gradient caching: exact large batches for losses that couple the samples of a batch.

A contrastive loss (CLIP's InfoNCE, NT-Xent, in-batch negatives) compares every sample with every
other one, so it is not a sum over micro-batches and plain accumulation changes it. Gradient
caching (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup", arXiv 2101.06983) splits the gradient at the representations r = f_theta(x) instead:

    dL/dtheta = sum_j (dr_j/dtheta)^T (dL/dr_j)        j: micro-batches of the batch

1. r_j = encode(x_j) for every micro-batch j without a graph (each j's RNG state saved);
2. L = loss(r) on the whole batch, backpropagated to the cached r (and to the loss's own
   parameters, such as a learned temperature, which get their gradient the normal way);
3. encode(x_j) again with j's RNG state restored (the same dropout masks), and backward of r_j
   with the slice dL/dr_j: the parameters receive exactly the full batch's gradient.

Peak memory is one micro-batch's activations plus the representations of the whole batch (and
their gradient) plus what the loss needs (its B x B similarity matrix); the price is one more
forward pass per sample. Steps 2-3 are an autograd Function: ``cached_loss`` returns L with a
graph whose backward runs step 3, so it composes with anything that calls ``backward`` on a loss
(GradScaler scaling, the Accumulator's weights).

Across data-parallel ranks (``gather``): the representations of all ranks are all-gathered
(without a graph: they are leaves of the loss), every rank computes the same loss over the global
batch and its gradient with respect to all representations, and backpropagates its own rows only.
Rank r's encoder gradient g_r is then one part of sum_r g_r; DDP averages over the W ranks, so each
rank scales its rows' gradient by W. Gradients are synchronised once per call (per Accumulator
window): every re-encode but the last runs under ``no_sync``. The loss's own parameters get the
full, identical gradient on every rank (keep them out of the DDP module, or in it: averaging
identical values keeps them).

What each rank holds: parameters, gradients (and DDP's buckets); its local batch; the gathered
representations of all ranks and their gradient (global batch x width per tower); the loss's
intermediate tensors over the global batch (the global B x B logits); and one micro-batch's
activations at a time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..errors import ConfigError, UsageError
from ..trees.batches import batch_size_of, tensors_of
from .accumulator import Accumulator
from .cached_arguments import check_arguments, should_gather
from .cached_tokens import cut_for_cache, restore_order

logger = logging.getLogger(__name__)

Encode = Callable[[Any], Any]
LossOfRepresentations = Callable[[Any], torch.Tensor]


# ---------------------------------------------------------------------- representation structure


@dataclass(frozen=True)
class _Structure:
    """How encode's output nests: one tensor, a tuple / list of tensors, or a dict of tensors."""

    container: type | None  # None: a bare tensor
    keys: tuple[Any, ...]
    shapes: tuple[tuple[int, ...], ...]  # per tensor, without dim 0
    dtypes: tuple[torch.dtype, ...]


def _flatten(representations: Any, *, rows: int, where: str) -> tuple[_Structure, list[torch.Tensor]]:
    if isinstance(representations, torch.Tensor):
        container: type | None = None
        keys: tuple[Any, ...] = (None,)
        tensors = [representations]
    elif isinstance(representations, Mapping):
        container, keys = type(representations), tuple(representations.keys())
        tensors = list(representations.values())
    elif isinstance(representations, (tuple, list)):
        container, keys = type(representations), tuple(range(len(representations)))
        tensors = list(representations)
    else:
        raise ConfigError(
            f"{where} returned {type(representations).__name__}; encode must return the representations "
            "as a tensor, a tuple / list of tensors, or a dict of tensors (samples on dim 0)"
        )
    if not tensors:
        raise ConfigError(f"{where} returned an empty {container.__name__ if container else 'value'}")
    for key, tensor in zip(keys, tensors, strict=True):
        name = "" if key is None else f"[{key!r}]"
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{where}{name} is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise ConfigError(
                f"{where}{name} has shape {tuple(tensor.shape)} but its micro-batch has {rows} samples: "
                "representations must have one row per sample on dim 0 (return per-sample embeddings, "
                "and compute anything that mixes samples inside loss)"
            )
    structure = _Structure(
        container,
        keys,
        tuple(tuple(t.shape[1:]) for t in tensors),
        tuple(t.dtype for t in tensors),
    )
    return structure, tensors


def _unflatten(structure: _Structure, tensors: Sequence[torch.Tensor]) -> Any:
    if structure.container is None:
        return tensors[0]
    if issubclass(structure.container, Mapping):
        return dict(zip(structure.keys, tensors, strict=True))
    container: Any = structure.container
    if issubclass(container, tuple) and hasattr(container, "_fields"):
        return container(*tensors)
    return container(tensors)


# ---------------------------------------------------------------------- RNG and autocast replay


def _rng_devices(batch: Any) -> list[torch.device]:
    """Devices whose RNG encode may draw from: the batch's, and the current CUDA device if in use."""
    devices = {str(t.device): t.device for t in tensors_of(batch) if t.device.type not in ("cpu", "meta")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        current = torch.device("cuda", torch.cuda.current_device())
        devices.setdefault(str(current), current)
    return list(devices.values())


def _index(device: torch.device) -> tuple[int, ...]:
    """The device argument of get_rng_state / set_rng_state: CUDA's index (current when absent)."""
    if device.type == "cuda":
        return (device.index if device.index is not None else torch.cuda.current_device(),)
    return ()  # mps and others: one generator, no device argument


def _rng_state(devices: Sequence[torch.device]) -> tuple[torch.Tensor, list[tuple[torch.device, Any]]]:
    states = []
    for device in devices:
        module = torch.get_device_module(device.type)
        states.append((device, module.get_rng_state(*_index(device))))
    return torch.get_rng_state(), states


def _set_rng_state(state: tuple[torch.Tensor, list[tuple[torch.device, Any]]]) -> None:
    cpu_state, device_states = state
    torch.set_rng_state(cpu_state)
    for device, device_state in device_states:
        module = torch.get_device_module(device.type)
        module.set_rng_state(device_state, *_index(device))


@contextlib.contextmanager
def _replayed_rng(saved: tuple[torch.Tensor, list[tuple[torch.device, Any]]]) -> Iterator[None]:
    """Run with a saved RNG state; the caller's RNG state is put back afterwards."""
    outer = _rng_state([device for device, _ in saved[1]])
    _set_rng_state(saved)
    try:
        yield
    finally:
        _set_rng_state(outer)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


# ---------------------------------------------------------------------- the autograd Function


@dataclass
class _Run:
    """One call's state, shared by the Function's forward (steps 1) and backward (step 3)."""

    encode: Encode
    micro_batches: list[Any]
    model: nn.Module | None
    gather: bool
    structure: _Structure | None = None
    rng_states: list[Any] | None = None
    autocast: list[tuple[str, bool, torch.dtype]] | None = None
    row_offset: int = 0  # this rank's first row in the gathered representations
    grad_scale: float = 1.0  # W when gathered and the model averages gradients over W ranks


def _encode_all(run: _Run) -> list[torch.Tensor]:
    """Step 1: every micro-batch through encode, without a graph; RNG state saved before each."""
    run.rng_states, run.autocast = [], _autocast_state()
    pieces: list[list[torch.Tensor]] = []
    for index, micro in enumerate(run.micro_batches):
        run.rng_states.append(_rng_state(_rng_devices(micro)))
        rows = batch_size_of(micro)
        structure, tensors = _flatten(run.encode(micro), rows=rows, where=f"encode(micro-batch {index})")
        if run.structure is None:
            run.structure = structure
        elif run.structure != structure:
            raise ConfigError(
                f"encode(micro-batch {index}) returned representations shaped {structure.shapes} "
                f"({structure.dtypes}, keys {structure.keys}) but micro-batch 0 gave {run.structure.shapes} "
                f"({run.structure.dtypes}, keys {run.structure.keys}); every micro-batch must give the same "
                "structure, width and dtype"
            )
        pieces.append([t.detach() for t in tensors])
    return [torch.cat(column) for column in zip(*pieces, strict=True)]


class _CachedEncode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, run: _Run) -> tuple[torch.Tensor, ...]:
        del anchor  # only puts this node into the graph
        ctx.run = run
        local = _encode_all(run)
        if run.gather:
            return tuple(_gather_rows(t, run) for t in local)
        return tuple(local)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None]:
        run, ctx.run = ctx.run, None  # free the micro-batches and RNG states after this backward
        if run is None:
            raise UsageError("cached_backward's loss was backpropagated twice; call cached_backward again")
        _replay_backward(run, list(grads))
        return None, None


def _structure_of(run: _Run) -> _Structure:
    if run.structure is None:
        raise RuntimeError("internal error: cached_backward's encode pass recorded no structure")
    return run.structure


def _replay_backward(run: _Run, grads: list[torch.Tensor]) -> None:
    """Step 3: re-encode each micro-batch with its RNG state; backward its slice of dL/dr."""
    if run.rng_states is None or run.autocast is None:
        raise RuntimeError("internal error: cached_backward's replay ran before its encode pass")
    expected = _structure_of(run)
    ddp = run.model if isinstance(run.model, nn.parallel.DistributedDataParallel) else None
    sync_at_end = ddp is not None and ddp.require_backward_grad_sync
    start = run.row_offset
    last = len(run.micro_batches) - 1
    for index, micro in enumerate(run.micro_batches):
        rows = batch_size_of(micro)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replayed_rng(run.rng_states[index]))
            stack.enter_context(torch.enable_grad())
            for device_type, enabled, dtype in run.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            if ddp is not None:  # DDP all-reduces in the last re-encode's backward only
                stack.enter_context(distributed.ddp_sync(ddp, enabled=sync_at_end and index == last))
            where = f"encode(micro-batch {index}) when replayed"
            structure, outputs = _flatten(run.encode(micro), rows=rows, where=where)
            if expected != structure:
                raise UsageError(
                    f"{where} returned representations shaped {structure.shapes} instead of "
                    f"{expected.shapes}: encode must be deterministic given the batch and the RNG state"
                )
            slices = [grad[start : start + rows] * run.grad_scale for grad in grads]  # x1.0 is exact
            pairs = [(out, piece) for out, piece in zip(outputs, slices, strict=True) if out.requires_grad]
            if not pairs:
                raise ConfigError(
                    f"{where} returned representations that do not require grad: encode must use parameters "
                    "that require grad, and must not run under torch.no_grad()"
                )
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        start += rows


# ---------------------------------------------------------------------- data-parallel gather


def _gather_rows(tensor: torch.Tensor, run: _Run) -> torch.Tensor:
    """All ranks' rows of ``tensor`` concatenated in rank order (uneven row counts allowed)."""
    world = dist.get_world_size()
    counts = _rows_per_rank(tensor.shape[0], tensor.device)
    run.row_offset = sum(counts[: dist.get_rank()])
    most = max(counts)
    padded = tensor.new_zeros((most, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def _rows_per_rank(rows: int, device: torch.device) -> list[int]:
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    counts[dist.get_rank()] = rows
    dist.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


# ---------------------------------------------------------------------- public API


def _check_ranks(run: _Run) -> None:
    """DDP broadcasts buffers in every forward: all ranks must run as many encode passes."""
    model = run.model
    if model is None:
        raise ConfigError(
            "gathering representations across ranks needs the DistributedDataParallel module as model= "
            "(or an Accumulator built on it as accumulator=): it synchronises the gradients once per call"
        )
    if distributed.data_parallel_kind(model) != "ddp":
        raise ConfigError(
            f"model= must be the DistributedDataParallel module when gathering across ranks, got "
            f"{type(model).__name__}; FSDP2 is not supported by cached_backward"
        )
    (most,) = distributed.all_reduce_values([float(len(run.micro_batches))], op="max")
    (total,) = distributed.all_reduce_values([float(len(run.micro_batches))])
    if most * distributed.world_size() != total:
        raise ConfigError(
            f"ranks split their local batches into different numbers of micro-batches (at most {int(most)}, "
            f"{int(total)} in all over {distributed.world_size()} ranks): DDP's forward passes must pair up "
            "across ranks; give every rank the same local batch size"
        )
    run.grad_scale = float(distributed.world_size())  # DDP averages: sum_r g_r = W * mean_r g_r


def cached_representations(
    encode: Encode,
    batch: Any,
    *,
    micro_batch_size: int | None = None,
    model: nn.Module | None = None,
    gather: bool | None = None,
    max_tokens: int | None = None,
    lengths: Sequence[int] | None = None,
) -> Any:
    """``encode(batch)``'s representations, computed ``micro_batch_size`` rows at a time without a graph.

    Their backward re-encodes each micro-batch (step 3 of the module docstring). Steps 1 and 3 of
    ``cached_loss`` alone: a loss over several calls' representations (one per tower or column, each
    encoded apart, so only one tower's micro-batch of activations is alive at a time) is exact too.
    """
    check_arguments(encode, len, micro_batch_size, max_tokens=max_tokens, gather=gather)
    if not torch.is_grad_enabled():
        raise UsageError(
            "cached_backward / cached_loss was called under torch.no_grad(): call it with grad enabled"
        )
    total = batch_size_of(batch)
    if total < 1:
        raise ConfigError(
            "cached_backward / cached_loss got an empty batch (0 samples): there is no loss to take; "
            "skip empty batches in the data"
        )
    micro_batches, order = cut_for_cache(batch, micro_batch_size, max_tokens=max_tokens, lengths=lengths)
    run = _Run(encode=encode, micro_batches=micro_batches, model=model, gather=should_gather(gather))
    if run.gather:
        _check_ranks(run)
    elif model is not None and distributed.data_parallel_kind(model) == "fsdp":
        raise ConfigError("cached_backward does not support FSDP2 models; use DDP (model=the DDP module)")
    anchor = torch.empty(0, requires_grad=True)
    flat = _CachedEncode.apply(anchor, run)
    flat = restore_order(flat, order)  # by tokens, rows were encoded longest first
    return _unflatten(_structure_of(run), flat)


def cached_loss(
    encode: Encode,
    batch: Any,
    loss: LossOfRepresentations,
    *,
    micro_batch_size: int | None = None,
    model: nn.Module | None = None,
    gather: bool | None = None,
    max_tokens: int | None = None,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """The full batch's loss, with a graph whose backward runs gradient caching (module docstring).

    ``loss.backward()`` (or ``scaler.scale(loss).backward()``, or ``Accumulator.backward``) fills the
    parameters' ``.grad`` with the full batch's gradient; the encode passes of step 1 have run when
    this returns, the re-encode passes run in that backward. See ``cached_backward`` for arguments.
    """
    check_arguments(encode, loss, micro_batch_size, max_tokens=max_tokens, gather=gather)
    representations = cached_representations(encode, batch, micro_batch_size=micro_batch_size,
        model=model, gather=gather, max_tokens=max_tokens, lengths=lengths)  # fmt: skip
    value = loss(representations)
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"loss(representations) must return a tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ConfigError(
            f"loss(representations) must return a scalar, got shape {tuple(value.shape)}: reduce it over "
            "the batch (a mean) inside loss"
        )
    if not value.requires_grad:
        raise ConfigError(
            "loss(representations) does not require grad: it must be computed from the representations "
            "it is given (not detached copies, not under torch.no_grad())"
        )
    return value.reshape(())


def cached_backward(
    encode: Encode,
    batch: Any,
    loss: LossOfRepresentations,
    *,
    micro_batch_size: int | None = None,
    accumulator: Any = None,
    model: nn.Module | None = None,
    gather: bool | None = None,
    max_tokens: int | None = None,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Backpropagate ``loss(encode(batch))`` over the whole batch, encoding ``micro_batch_size`` at a time.

    ``encode(micro_batch)`` -> per-sample representations (a tensor, or a tuple / list / dict of them
    for several towers); ``batch``: the whole batch (tensor / tuple / list / dict, samples on dim 0);
    ``loss(representations of the whole batch)`` -> a scalar. Every parameter's ``.grad`` then adds the
    full batch's gradient, also with dropout (RNG replayed) and checkpointing inside encode.

    ``accumulator``: a ``microbatch.Accumulator`` whose window holds several such batches; the
    backward goes through ``accumulator.backward(loss, items=B)`` with B the (global) batch size, so
    the window's gradient is the item-weighted mean of its batches' gradients, and clipping, GradScaler
    unscaling and the scheduler act once per window in ``accumulator.step()``. With ``gather`` every
    rank weighs the global loss by the global batch size, so ``WindowStats.items`` counts each sample
    once per rank. Without an accumulator, a GradScaler is applied as ``scaler.scale(cached_loss(...))
    .backward()`` with ``microbatch.accumulate.cached.cached_loss``.

    ``gather``: all-gather the representations over the ranks so the loss sees the global batch
    (default: when torch.distributed runs several ranks); ``model`` (or the accumulator's) must then be
    the DDP module; gradients sync once per call (per window with an accumulator). Memory per rank: see
    the module docstring. Returns the loss, detached.
    ``max_tokens`` / ``lengths``: cut by padded tokens, gradient unchanged (accumulate/cached_tokens.py).
    """
    if accumulator is not None:
        if not isinstance(accumulator, Accumulator):
            raise ConfigError(
                f"accumulator must be a microbatch.Accumulator, got {type(accumulator).__name__}"
            )
        if model is not None and model is not accumulator.model:
            raise ConfigError("model= and accumulator= name different models; pass only accumulator=")
        model = accumulator.model
    value = cached_loss(encode, batch, loss, micro_batch_size=micro_batch_size, model=model, gather=gather,
                        max_tokens=max_tokens, lengths=lengths)  # fmt: skip
    if accumulator is None:
        value.backward()
        return value.detach()
    items = batch_size_of(batch)
    if should_gather(gather):
        (items_float,) = distributed.all_reduce_values([float(items)])
        items = round(items_float)
    accumulator.backward(value, items=items)
    return value.detach()
