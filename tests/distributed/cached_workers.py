"""What each rank runs in the gradient-caching DDP tests (tests/distributed/test_cached_ddp.py).

Every rank builds the same dual encoder and InfoNCE loss from one seed; rank r takes rows
[offsets[r], offsets[r + 1]) of each global batch. The DDP module wraps the encoder; the loss's
learned temperature stays outside it (every rank computes its full gradient itself).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import microbatch as mb
from dual_encoder import make_batch, make_models

MICRO = 4


def local_rows(batch: dict[str, torch.Tensor], local_sizes: list[int]) -> dict[str, torch.Tensor]:
    start = sum(local_sizes[: dist.get_rank()])
    return {k: v[start : start + local_sizes[dist.get_rank()]] for k, v in batch.items()}


def _ddp(encoder: nn.Module) -> tuple[nn.parallel.DistributedDataParallel, list[int]]:
    ddp = nn.parallel.DistributedDataParallel(encoder)
    calls: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, hook)
    return ddp, calls


def one_batch(local_sizes: list[int], seed: int) -> dict[str, Any]:
    """One cached_backward over the global batch; the gradients and the all-reduce count."""
    encoder, loss_fn = make_models(dropout=0.0)
    ddp, calls = _ddp(encoder)
    batch = local_rows(make_batch(sum(local_sizes), seed=seed), local_sizes)
    loss = mb.cached_backward(ddp, batch, loss_fn, micro_batch_size=MICRO, model=ddp)
    grads = {f"0.{n}": p.grad.clone() for n, p in encoder.named_parameters()}
    grads.update({f"1.{n}": p.grad.clone() for n, p in loss_fn.named_parameters()})
    return {"loss": float(loss), "grads": grads, "allreduce_calls": len(calls)}


def window(local_sizes: list[list[int]], seeds: list[int], lr: float, max_grad_norm: float) -> dict[str, Any]:
    """A window of several global batches through the Accumulator (one step); the parameters after it."""
    encoder, loss_fn = make_models(dropout=0.0)
    ddp, calls = _ddp(encoder)
    optimizer = torch.optim.SGD([*encoder.parameters(), *loss_fn.parameters()], lr=lr)
    acc = mb.Accumulator(ddp, optimizer, steps=len(seeds), max_grad_norm=max_grad_norm)
    batches = [
        local_rows(make_batch(sum(s), seed=seed), s) for s, seed in zip(local_sizes, seeds, strict=True)
    ]
    stats = None
    for micro in acc.iterate(batches):
        mb.cached_backward(ddp, micro.batch, loss_fn, micro_batch_size=MICRO, accumulator=acc)
        if micro.is_last:
            stats = acc.step()
    assert stats is not None
    params = {f"0.{n}": p.detach().clone() for n, p in encoder.named_parameters()}
    params.update({f"1.{n}": p.detach().clone() for n, p in loss_fn.named_parameters()})
    return {"params": params, "loss": stats.loss, "grad_norm": stats.grad_norm, "allreduce_calls": len(calls)}


def run_all(local_sizes: list[int], window_sizes: list[list[int]], seeds: list[int]) -> dict[str, Any]:
    return {
        "one_batch": one_batch(local_sizes, seed=seeds[0]),
        "window": window(window_sizes, seeds, lr=0.5, max_grad_norm=0.05),
    }
