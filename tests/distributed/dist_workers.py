"""What each rank runs in the distributed tests, and the data and model both sides rebuild.

The tests launch these functions on two gloo processes (microbatch.distributed.launch) and compute
the single-process full-batch reference themselves, from the same seeds.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import microbatch as mb
from microbatch.errors import ConfigError

VOCAB = 11
LENGTH = 6

Batch = tuple[torch.Tensor, torch.Tensor]


class TinyLM(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def make_model() -> TinyLM:
    torch.manual_seed(1234)
    return TinyLM().double()


def token_mean(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the tokens whose label is not -100, and their count."""
    tokens, labels = batch
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, (labels != -100).sum()


def micro_batches(rank: int, sizes: list[int]) -> list[Batch]:
    """Rank ``rank``'s micro-batches: ``sizes[i]`` sequences each, with very different token counts."""
    batches = []
    for i, size in enumerate(sizes):
        g = torch.Generator().manual_seed(1000 * rank + i)
        tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=g)
        labels = torch.randint(0, VOCAB, (size, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (size,), generator=g)
        labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
        batches.append((tokens, labels))
    return batches


def window_batches(sizes_per_rank: list[list[int]], steps: int) -> list[Batch]:
    """The global batch of each window: window w holds micro-batches w*steps .. (w+1)*steps - 1 of
    every rank that has them, gathered into one batch."""
    data = [micro_batches(r, sizes) for r, sizes in enumerate(sizes_per_rank)]
    windows = -(-max(len(d) for d in data) // steps)
    gathered = []
    for w in range(windows):
        pieces = [b for d in data for b in d[w * steps : (w + 1) * steps]]
        gathered.append((torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])))
    return gathered


def reference_grads(batch: Batch, max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Single-process full-batch gradient of the mean token loss (optionally clipped)."""
    model = make_model()
    token_mean(model, batch)[0].backward()
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_windows_match(
    captured: list[dict[str, torch.Tensor]],
    sizes_per_rank: list[list[int]],
    steps: int,
    max_grad_norm: float | None = None,
    **tolerance: float,
) -> None:
    """Each window's captured gradient equals the full-batch gradient of that window's global batch."""
    windows = window_batches(sizes_per_rank, steps)
    assert len(captured) == len(windows)
    for index, (grads, batch) in enumerate(zip(captured, windows, strict=True)):
        expected = reference_grads(batch, max_grad_norm)
        assert grads.keys() == expected.keys()
        for name in expected:
            where = f"window {index}, {name}"
            torch.testing.assert_close(
                grads[name], expected[name], msg=lambda m, w=where: f"{w}: {m}", **tolerance
            )


# ---------------------------------------------------------------------- per-rank runs


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor; gathering it is a collective
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return grads


def _train(
    wrapped: nn.Module,
    inner: nn.Module,
    data: list[Batch],
    steps: int,
    *,
    on_micro: Callable[[Any], None] | None = None,
    loss_fn: Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]] = token_mean,
    **options: Any,
) -> dict[str, Any]:
    """Accumulate over ``data``; capture the gradient each optimizer step sees (lr=0 keeps weights)."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: captured.append(_full_grads(inner)))
    acc = mb.Accumulator(wrapped, optimizer, steps=steps, **options)
    stats, padding = [], []
    for micro in acc.iterate(data):
        if on_micro is not None:
            on_micro(micro)
        padding.append(micro.is_padding)
        loss, items = loss_fn(wrapped, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            stats.append(acc.step().to_dict())
    return {"grads": captured, "stats": stats, "padding": padding}


def _ddp_counted(model: nn.Module) -> tuple[nn.Module, list]:
    """DDP with a comm hook that does what the default does (average) and records, for every bucket
    all-reduce, the (window, index) of the micro-batch whose backward launched it."""
    ddp = mb.distributed.wrap_data_parallel(model, torch.device("cpu"))
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    calls: list[tuple[int, int]] = []
    position = {"now": (-1, -1)}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls.append(position["now"])
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, hook)
    ddp._microbatch_position = position  # type: ignore[assignment]
    return ddp, calls


def _ddp_train(sizes: list[int], steps: int, **options: Any) -> dict[str, Any]:
    model = make_model()
    ddp, calls = _ddp_counted(model)
    position = ddp._microbatch_position  # type: ignore[attr-defined]
    data = micro_batches(dist.get_rank(), sizes)

    def on_micro(micro: Any) -> None:
        position["now"] = (micro.window, micro.index)

    result = _train(ddp, model, data, steps, on_micro=on_micro, **options)
    result["hook_calls"] = calls
    return result


def ddp_all(sizes_per_rank: list[list[int]], steps: int, uneven_per_rank: list[list[int]]) -> dict[str, Any]:
    """Every DDP scenario in one launch (spawning processes is the slow part)."""
    rank = dist.get_rank()
    sizes = sizes_per_rank[rank]
    result: dict[str, Any] = {
        "world_size_from_env": mb.distributed.world_size_from_env(),
        "skip": _ddp_train(sizes, steps),
        "every": _ddp_train(sizes, steps, sync_every_micro_batch=True),
        "clip": _ddp_train(sizes, steps, max_grad_norm=0.05),
        "uneven": _ddp_train(uneven_per_rank[rank], steps),
        # steps=1: the agreement rides entirely in step()'s all_reduce.
        "uneven_steps_1": _ddp_train(uneven_per_rank[rank], 1),
    }

    # A loader that is empty on one rank: a clear error on every rank, not a hang.
    model = make_model()
    acc = mb.Accumulator(
        nn.parallel.DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.0), steps=steps
    )
    try:
        for _ in acc.iterate([] if rank == 1 else micro_batches(rank, [2, 2])):
            pass
        result["empty_error"] = None
    except ConfigError as error:
        result["empty_error"] = str(error)

    # The inner module passed instead of the DDP wrapper: a warning (rank 0 only).
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("microbatch").addHandler(handler)
    local = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2)
    logging.getLogger("microbatch").removeHandler(handler)
    result["inner_module_warnings"] = records
    # It still trains on the rank's own data (no collectives, no agreement, no spurious error).
    for micro in local.iterate(micro_batches(rank, [1, 2, 3])):
        loss, items = token_mean(model, micro.batch)
        local.backward(loss, items=items)
        if micro.is_last:
            result.setdefault("inner_module_windows", []).append(local.step().micro_batches)
    return result


# ---------------------------------------------------------------------- FSDP2


def _fsdp_model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Linear on a 3-d input returns a view; nothing here modifies outputs in place.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    fully_shard(model.mix, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_sync_flags(model: nn.Module) -> list[bool]:
    """FSDP2's per-group reduce flag, read from its (private) state: what set_requires_gradient_sync sets."""
    from torch.distributed.fsdp import FSDPModule

    return [
        group.reduce_grads
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


def _fsdp_train(sizes: list[int], steps: int, **options: Any) -> dict[str, Any]:
    model = _fsdp_model()
    flags_in_backward: list[bool] = []

    def watched_loss(m: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, items = token_mean(m, batch)
        # Runs inside backward, before any FSDP post-backward hook: the flag that backward sees.
        loss.register_hook(lambda g: flags_in_backward.append(all(fsdp_sync_flags(model))) or g)
        return loss, items

    result = _train(
        model, model, micro_batches(dist.get_rank(), sizes), steps, loss_fn=watched_loss, **options
    )
    result["flags_in_backward"] = flags_in_backward
    result["flags_after"] = fsdp_sync_flags(model)
    return result


def fsdp_all(sizes_per_rank: list[list[int]], steps: int, uneven_per_rank: list[list[int]]) -> dict[str, Any]:
    """Every FSDP2 scenario in one launch."""
    sizes = sizes_per_rank[dist.get_rank()]
    result: dict[str, Any] = {
        "skip": _fsdp_train(sizes, steps),
        "every": _fsdp_train(sizes, steps, sync_every_micro_batch=True),
        "clip": _fsdp_train(sizes, steps, max_grad_norm=0.05),
        "uneven": _fsdp_train(uneven_per_rank[dist.get_rank()], steps),
    }
    data = micro_batches(dist.get_rank(), sizes)

    # An exception in the loop body of a non-last micro-batch, the generator still referenced.
    model = _fsdp_model()
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=steps)
    micro_iter = acc.iterate(data)
    try:
        for micro in micro_iter:
            loss, items = token_mean(model, micro.batch)
            raise RuntimeError("the loop body failed on purpose")
    except RuntimeError:
        result["flags_after_body_error"] = fsdp_sync_flags(model)

    # An exception inside backward() of a non-last micro-batch.
    model = _fsdp_model()
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=steps)
    micro_iter = acc.iterate(copy.copy(data))
    try:
        for micro in micro_iter:
            loss, items = token_mean(model, micro.batch)
            acc.backward(_FailingBackward.apply(loss), items=items)
    except RuntimeError as error:
        result["backward_error"] = str(error)
        result["flags_after_backward_error"] = fsdp_sync_flags(model)
    return result
