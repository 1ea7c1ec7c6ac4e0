"""Checkpointing, planning and accumulation on torch.compile'd models.

Backend aot_eager (dynamo + AOT autograd's partitioner, no code generation): the compiled backward
runs no Python, which is what the compile-safe checkpoint forms must survive. Inductor runs the same
check when MICROBATCH_TEST_INDUCTOR=1 (tens of seconds of C++ compilation on a loaded CPU).

Tolerances: float64. Gradients and outputs against the eager, uncheckpointed model: rtol = atol =
1e-10 (the compiled graph may fuse or reorder additions; nothing else may differ). BatchNorm running
statistics likewise, and num_batches_tracked exactly.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import microbatch as mb
from microbatch import distributed
from microbatch.checkpointing import compiled
from microbatch.checkpointing.api import POLICIES

TOL = {"rtol": 1e-10, "atol": 1e-10}


class Block(nn.Module):
    """Linear -> BatchNorm -> tanh -> Linear, residual; a cache switch like HF decoder layers."""

    def __init__(self, width: int = 8, norm: type[nn.Module] = nn.BatchNorm1d) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.bn = norm(2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        return x + self.out(torch.tanh(self.bn(self.fc(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = 8, norm: type[nn.Module] = nn.BatchNorm1d) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, norm) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, use_cache=True)  # the checkpoint turns it off; its notice must not break the graph
        return self.head(x).square().mean()


class Recording:
    """A dynamo backend: aot_eager, keeping every graph it is given."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = torch._dynamo.lookup_backend(inner)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(graph)
        return self.inner(graph, example_inputs)

    def checkpoint_regions(self) -> int:
        return sum("checkpoint" in str(node.target) for graph in self.graphs for node in graph.graph.nodes)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _train(model: nn.Module, runner: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    losses = []
    for x in inputs:
        model.zero_grad(set_to_none=True)
        loss = runner(x)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _compare(
    model: nn.Module, reference: nn.Module, losses: list[torch.Tensor], expected: list[torch.Tensor]
) -> None:
    torch.testing.assert_close(losses, expected, **TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"gradient of {name}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, **TOL, msg=f"buffer {name}")


def _graph_breaks() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("order", ["checkpoint-then-compile", "compile-then-checkpoint"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_compiles_in_one_graph_with_eager_gradients(policy: str, order: str) -> None:
    model = Net().double()
    reference = copy.deepcopy(model)
    inputs = [torch.randn(6, 8, dtype=torch.float64) for _ in range(2)]
    expected = _train(reference, reference, inputs)
    backend = Recording()
    if order == "checkpoint-then-compile":
        handle = mb.checkpoint(model, policy=policy)
        runner = torch.compile(model, backend=backend)
    else:
        runner = torch.compile(model, backend=backend)
        handle = mb.checkpoint(runner, policy=policy)
    assert handle.blocks == ["blocks.0", "blocks.1", "blocks.2"]  # names inside _orig_mod
    _compare(model, reference, _train(model, runner, inputs), expected)
    assert _graph_breaks() == {}
    assert len(backend.graphs) == 1
    assert backend.checkpoint_regions() == 3  # one tagged region per block: the checkpoint is in the graph
    assert handle.compiled_calls
    handle.remove()


def test_compiled_form_is_checkpointed_and_repeats_dropout_masks() -> None:
    # Dropout: the compiled checkpoint must give the same gradients as the compiled uncheckpointed
    # model drawing the same masks (the partitioner saves random masks rather than redrawing them).
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(3))
    ).double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.manual_seed(3)
    torch.compile(reference, backend="aot_eager")(x).sum().backward()
    mb.checkpoint(model, policy="full")
    torch.manual_seed(3)
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_checkpointing_a_compiled_model_says_what_the_policies_become(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runner = torch.compile(Net(), backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="microbatch"):
        mb.checkpoint(runner, policy="offload")
    assert "torch.compile'd model" in caplog.text
    assert "offload -> full" in caplog.text


@pytest.mark.skipif(
    os.environ.get("MICROBATCH_TEST_INDUCTOR") != "1", reason="set MICROBATCH_TEST_INDUCTOR=1"
)
@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_inductor_gradients_equal_eager(policy: str) -> None:
    model = Net(depth=2).double()
    reference = copy.deepcopy(model)
    inputs = [torch.randn(6, 8, dtype=torch.float64)]
    expected = _train(reference, reference, inputs)
    mb.checkpoint(model, policy=policy)
    _compare(model, reference, _train(model, torch.compile(model, backend="inductor"), inputs), expected)


def _workload(model: nn.Module) -> mb.Workload:
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> torch.Tensor:
        return torch.randn(size, 8, generator=generator)

    def loss(module: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return module(batch), int(batch.shape[0])

    return mb.Workload(model=model, make_batch=make_batch, loss=loss, name="compiled-net")


def test_plan_on_a_compiled_model_profiles_eagerly_and_leaves_compile_on() -> None:
    model = Net(depth=3, norm=nn.LayerNorm)  # BatchNorm cannot train on the profile's micro-batch 1
    backend = Recording()
    runner = torch.compile(model, backend=backend)
    plan = mb.plan(
        _workload(runner), batch=8, memory="64MiB", max_profile_micro_batch_size=4, policies=["none", "full"]
    )
    assert compiled.COMPILED_PLAN_NOTE in plan.notes
    assert backend.graphs == []  # profiling and the trial ran the eager module only
    assert all(name.startswith("blocks.") for name, _ in plan.block_policies)
    accumulator = plan.apply(runner, torch.optim.SGD(model.parameters(), lr=0.1))
    for micro in accumulator.iterate(torch.randn(plan.micro_batch_size, 8) for _ in range(plan.steps)):
        accumulator.backward(runner(micro.batch), items=micro.batch.shape[0])
        if micro.is_last:
            accumulator.step()
    assert len(backend.graphs) >= 1  # the training loop ran compiled code
    assert torch._dynamo.config.disable is False


def test_ddp_inside_compile_is_detected(tmp_path: Any) -> None:
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        runner = torch.compile(ddp, backend="aot_eager")
        assert distributed.data_parallel_kind(runner) == "ddp"
        with distributed.ddp_sync(runner, enabled=False):
            assert ddp.require_backward_grad_sync is False  # no_sync reached the DDP module inside
        assert ddp.require_backward_grad_sync is True
    finally:
        torch.distributed.destroy_process_group()


def test_memory_tracker_says_a_compiled_model_is_measured_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    runner = torch.compile(Net(), backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="microbatch"), mb.MemoryTracker(model=runner):
        pass
    assert "runs eagerly" in caplog.text
