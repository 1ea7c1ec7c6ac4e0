"""What each rank runs in the planned-FSDP2 tests: a 4-block MLP sharded with fully_shard, trained by
a plan made with mb.plan(..., world_size=2, shard="fsdp"), its peak measured by a tracker opened
outside the plan, and the gradient each optimizer step sees."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import microbatch as mb

WIDTH = 64
BLOCKS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> MLP:
    torch.manual_seed(7)
    return MLP().double()


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y), len(y)


def make_batch(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, WIDTH, generator=g, dtype=torch.float64), torch.randn(
        size, generator=g, dtype=torch.float64
    )


def workload() -> mb.Workload:
    model = make_model()
    return mb.Workload(
        model=model,
        make_batch=make_batch,
        loss=loss_fn,
        optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.0),
        name="mlp4",
    )


def micro_batch(window: int, rank: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``rank`` in ``window``: made when its turn comes, as a loader would."""
    return make_batch(size, seed=10_000 * window + 100 * rank + index)


def reference_grads(window: int, sizes: list[int], world_size: int) -> dict[str, torch.Tensor]:
    """The full-batch gradient of window ``window``: every rank's micro-batches in one batch."""
    pieces = [micro_batch(window, r, i, size) for r in range(world_size) for i, size in enumerate(sizes)]
    batch = (torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]))
    model = make_model()
    loss_fn(model, batch)[0].backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return grads


def train_plan(plan_dict: dict[str, Any], windows: int, apply_options: dict[str, Any]) -> dict[str, Any]:
    """Train ``windows`` windows of the plan on this rank; per-window peaks and captured gradients."""
    plan = mb.Plan.from_dict(plan_dict)
    rank = dist.get_rank()
    model = _sharded(make_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: captured.append(_full_grads(model)))
    accumulator = plan.apply(model, optimizer, **apply_options)
    peaks, parts = [], []
    for window in range(windows):
        feed = (micro_batch(window, rank, i, size) for i, size in enumerate(plan.micro_batch_sizes))
        with mb.MemoryTracker(torch.device("cpu"), model=model, optimizer=optimizer) as tracker:
            for micro in accumulator.iterate(feed):
                loss, items = loss_fn(model, micro.batch)
                accumulator.backward(loss, items=items)
                del loss
                if micro.is_last:
                    accumulator.step()
        peaks.append(tracker.peak_bytes)
        parts.append(tracker.to_dict())
    return {"peaks": peaks, "parts": parts, "grads": captured}


def train_plans(plan_dicts: dict[str, dict[str, Any]], windows: int) -> dict[str, dict[str, Any]]:
    """``train_plan`` for each plan, by name, in one process group."""
    return {name: train_plan(plan_dict, windows, {}) for name, plan_dict in plan_dicts.items()}


def ddp_plan(plan_dict: dict[str, Any], windows: int) -> dict[str, Any]:
    """plan.apply on the DDP wrapper: blocks checkpointed inside, one all-reduce per window (no_sync)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    plan = mb.Plan.from_dict(plan_dict)
    rank = dist.get_rank()
    ddp = nn.parallel.DistributedDataParallel(make_model())
    reduces: list[int] = []

    def counted(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        reduces.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counted)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.0)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: captured.append(_full_grads(ddp.module)))
    accumulator = plan.apply(ddp, optimizer)
    # checkpoint() gives each checkpointed block an instance forward
    checkpointed = ["forward" in block.__dict__ for block in ddp.module.blocks]
    per_window = []
    for window in range(windows):
        before = len(reduces)
        feed = [micro_batch(window, rank, i, size) for i, size in enumerate(plan.micro_batch_sizes)]
        for micro in accumulator.iterate(feed):
            loss, items = loss_fn(ddp, micro.batch)
            accumulator.backward(loss, items=items)
            if micro.is_last:
                accumulator.step()
        per_window.append(len(reduces) - before)
    plan.remove(ddp)
    removed = not any("forward" in block.__dict__ for block in ddp.module.blocks)
    return {"grads": captured, "reduces": per_window, "checkpointed": checkpointed, "removed": removed}


def prove_plans(plan_dicts: dict[str, dict[str, Any]], windows: int) -> dict[str, dict[str, Any]]:
    """mb.prove on this rank's FSDP2-sharded model for each plan (all ranks together), then the same
    plan trained under the outside tracker; and the proof of a copy whose budget is below the peak."""
    import dataclasses

    from microbatch.planner import prove

    found: dict[str, dict[str, Any]] = {}
    for name, plan_dict in plan_dicts.items():
        plan = mb.Plan.from_dict(plan_dict)
        sharded = mb.Workload(
            model=_sharded(make_model()),
            make_batch=make_batch,
            loss=loss_fn,
            optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.0),
            name="mlp4",
        )
        proved = prove(plan, sharded)
        tight = dataclasses.replace(plan, budget_bytes=proved.measured_peak_bytes - 1)
        try:
            prove(tight, sharded)
            refused = ""
        except mb.InfeasibleBudgetError as error:
            refused = str(error)
        found[name] = {
            "measured": proved.measured_peak_bytes,
            "notes": list(proved.notes),
            "refused": refused,
            "training": train_plan(plan_dict, windows, {})["peaks"],
        }
    return found
