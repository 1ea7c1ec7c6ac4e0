"""Profiling: fits, per-block bytes against hand-counted tensors, static memory, restoring the model."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

from microbatch.errors import InfeasibleBudgetError, WorkloadError
from microbatch.profile import Fit, default_micro_batch_sizes, profile_workload
from microbatch.workload import Workload

WIDTH, HIDDEN, INPUT = 16, 64, 8
FLOAT = 4  # bytes


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUT, WIDTH)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(depth))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)  # type: ignore[no-any-return]


def mlp_workload(model: nn.Module | None = None, *, optimizer: Any = None) -> Workload:
    generator = torch.Generator().manual_seed(0)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, INPUT, generator=generator), torch.randn(b, 1, generator=generator)

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return nn.functional.mse_loss(m(batch[0]), batch[1]), int(batch[0].shape[0])

    return Workload(
        model=model if model is not None else MLP(),
        make_batch=make_batch,
        loss=loss,
        optimizer=optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
        name="mlp",
    )


def test_fit_is_least_squares_and_interpolates() -> None:
    line = Fit.of([1, 2, 4], [3.0, 5.0, 9.0])  # exactly 1 + 2 b
    assert (line.intercept, line.slope) == pytest.approx((1.0, 2.0))
    assert line(10) == pytest.approx(21.0)
    assert line.relative_miss() == pytest.approx(0.0)
    # max(5, b): convex; the chords lie above it, and beyond the sizes the last piece continues.
    convex = Fit.of([1, 4, 8], [5.0, 5.0, 8.0], interpolate=True)
    assert convex(2) == 5.0
    assert convex(6) == pytest.approx(6.5)  # chord from (4, 5) to (8, 8); max(5, 6) = 6 lies below
    assert convex(16) == pytest.approx(14.0)
    assert not convex.is_linear(floor=0.0)
    # A time cannot fall with the micro-batch size: a negative slope is flattened.
    assert Fit.of([1, 2, 4], [3.0, 2.0, 1.0], nonnegative=True).slope == 0.0
    assert Fit.of([2, 4], [1.0, 5.0], nonnegative=True).intercept == 0.0  # the line would cross at -3


def test_default_sizes() -> None:
    assert default_micro_batch_sizes(16) == (1, 8, 16)
    assert default_micro_batch_sizes(2) == (1, 2)
    assert default_micro_batch_sizes(1) == (1,)


def test_block_bytes_match_the_tensors_autograd_keeps() -> None:
    profile = profile_workload(mlp_workload(), micro_batch_sizes=(1, 2, 4), repeats=1)
    names = [segment.name for segment in profile.segments]
    assert names == [
        "(before blocks)",
        "blocks.0",
        "(between blocks.0 and blocks.1)",
        "blocks.1",
        "(between blocks.1 and blocks.2)",
        "blocks.2",
        "(after blocks)",
    ]
    assert [segment.name for segment in profile.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert profile.policies == ("none", "full", "selective")  # no offload on the CPU
    for block in profile.blocks:
        none, full = block.costs["none"], block.costs["full"]
        for size, kept_none, kept_full in zip(
            none.kept_bytes.sizes, none.kept_bytes.values, full.kept_bytes.values, strict=True
        ):
            # none: relu's output (saved by relu and fc2, one storage) and the block's output.
            assert kept_none == FLOAT * size * (HIDDEN + WIDTH)
            # full: only the output; the input the checkpoint holds was live before the block.
            assert kept_full == FLOAT * size * WIDTH
        assert block.boundary_bytes.values == tuple(float(FLOAT * s * WIDTH) for s in none.kept_bytes.sizes)
        # The recomputed block's activations live again in its backward: same peak as none.
        assert full.peak_bytes.values == none.peak_bytes.values
        assert none.peak_bytes(4) >= none.kept_bytes(4)
        assert none.forward_seconds(4) >= 0 and full.backward_seconds(4) >= 0
    # The chain reproduces the tracked runs' peaks: nothing left for the slack at the profiled sizes.
    assert profile.slack_bytes == 0


def test_static_memory_comes_from_the_real_optimizer() -> None:
    model = MLP()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adamw = profile_workload(mlp_workload(model), micro_batch_sizes=(1, 2), repeats=1)
    assert adamw.parameter_bytes == adamw.gradient_bytes == parameter_bytes
    # AdamW keeps exp_avg and exp_avg_sq (two parameter copies) and a 4-byte step per parameter.
    assert adamw.optimizer_bytes == 2 * parameter_bytes + 4 * len(list(model.parameters()))
    assert adamw.optimizer_name == "AdamW"
    sgd = profile_workload(
        mlp_workload(model, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
        micro_batch_sizes=(1, 2),
        repeats=1,
    )
    assert sgd.optimizer_bytes == 0


def test_profiling_leaves_the_model_as_it_was() -> None:
    from microbatch.models.workloads import cnn_bn

    workload = cnn_bn()
    workload.model.eval()
    before = copy.deepcopy(workload.model.state_dict())
    rng = torch.get_rng_state()
    profile = profile_workload(
        workload, blocks=["blocks.0", "blocks.1", "blocks.2"], micro_batch_sizes=(1, 2), repeats=1
    )
    assert profile.optimizer_name == "SGD"
    after = workload.model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name  # weights and BatchNorm statistics
    assert not workload.model.training
    assert all(p.grad is None for p in workload.model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any("_microbatch_checkpoint_policy" in m.__dict__ for m in workload.model.modules())


class QuadraticBlock(nn.Module):
    """Saves a b x b attention over the batch: memory grows as b squared."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.softmax(x @ x.T, dim=-1) @ self.proj(x)


def test_nonlinear_costs_are_logged_not_noted(caplog: pytest.LogCaptureFixture) -> None:
    # A miss of the linear fit changes no decision the user can take: a DEBUG line, not a plan note.
    model = MLP()
    model.blocks = nn.ModuleList(QuadraticBlock() for _ in range(2))
    with caplog.at_level(logging.DEBUG, logger="microbatch.profile"):
        profile = profile_workload(
            mlp_workload(model), micro_batch_sizes=(1, 128, 256), repeats=1, policies=("none",)
        )
    assert "not linear" in caplog.text and "blocks.0 none kept_bytes" in caplog.text
    assert not any("not linear" in note for note in profile.notes)


class FailingBatches:
    """A loss that raises torch's out-of-memory error from a micro-batch size on."""

    def __init__(self, workload: Workload, from_size: int) -> None:
        self.workload, self.from_size = workload, from_size

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        if batch[0].shape[0] >= self.from_size:
            raise torch.OutOfMemoryError("injected: out of memory")
        return self.workload.loss(model, batch)


def test_sizes_that_run_out_of_memory_are_dropped() -> None:
    workload = mlp_workload()
    workload.loss = FailingBatches(mlp_workload(workload.model), from_size=4)
    profile = profile_workload(workload, micro_batch_sizes=(1, 2, 4), repeats=1)
    assert profile.micro_batch_sizes == (1, 2)
    assert any("micro-batch 4 ran out of memory" in note for note in profile.notes)
    for segment in profile.segments:
        for cost in segment.costs.values():
            assert cost.kept_bytes.sizes == (1, 2)


def test_out_of_memory_everywhere_is_an_infeasible_budget() -> None:
    workload = mlp_workload()
    workload.loss = FailingBatches(mlp_workload(workload.model), from_size=1)
    with pytest.raises(InfeasibleBudgetError, match="runs out of memory"):
        profile_workload(workload, micro_batch_sizes=(1, 2), repeats=1)


def test_progress_is_reported() -> None:
    calls: list[tuple[str, int, int]] = []
    profile_workload(
        mlp_workload(), micro_batch_sizes=(1, 2), repeats=2, progress=lambda *args: calls.append(args)
    )
    # Memory: per size, none once and each of full, selective twice (first call, steady state).
    # Time: per round, every (policy, size) once plus each checkpoint's untimed first call.
    # Rounds beyond the two asked (up to measure.EXTRA_ROUNDS = 2 more) run while the times have not settled
    # (measure.STABLE_NOISE), each announced by a larger total before it runs.
    total = 2 * (1 + 2 * 2) + 2 * (3 * 2 + 2)
    last = calls[-1][2]
    assert (last - total) % (3 * 2 + 2) == 0 and total <= last <= total + 2 * (3 * 2 + 2)
    assert [done for _, done, _ in calls] == [*range(last), last]
    totals = [all_runs for _, _, all_runs in calls]
    assert totals[0] == total and totals == sorted(totals)
    assert all(done <= all_runs for _, done, all_runs in calls)
    assert any("policy full, micro-batch 2" in what for what, _, _ in calls)


def test_first_call_of_a_checkpoint_is_measured_apart() -> None:
    profile = profile_workload(mlp_workload(), micro_batch_sizes=(1, 2, 4), repeats=1)
    for block in profile.blocks:
        for policy, cost in block.costs.items():
            for size in (1, 2, 4):
                # A first call keeps at least what the steady state keeps; none has no first call.
                assert cost.kept(size, first=True) >= cost.kept(size)
                assert cost.peak(size, first=True) >= cost.peak(size)
            if policy == "none":
                assert cost.first_kept_bytes is None


class SkippingMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks[:-1]:
            x = block(x)
        return self.out(x)  # type: ignore[no-any-return]


class RepeatingMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in [*self.blocks, self.blocks[0]]:
            x = block(x)
        return self.out(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("model", "message"), [(SkippingMLP(), "did not run"), (RepeatingMLP(), "twice")])
def test_blocks_must_run_once(model: nn.Module, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        profile_workload(mlp_workload(model), micro_batch_sizes=(1,), repeats=1, policies=("none",))
