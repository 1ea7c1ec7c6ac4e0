"""The planner profiles and trials the model itself: never two copies of its parameters on its device.

A model whose (mostly frozen) parameters take 60 % of the budget is planned on the CPU inside an
outer MemoryTracker, which sees every tensor the planner makes: its peak stays within the budget,
so no copy of the parameters was ever alive beside them. Afterwards the model, its gradients, its
modes, an optimizer instance's state and the RNG are exactly as before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from microbatch.errors import InfeasibleBudgetError
from microbatch.memory import MemoryTracker
from microbatch.planner import plan
from microbatch.profile import preserved_state
from microbatch.workload import Workload

VOCAB, WIDTH, LENGTH = 40_000, 64, 8


class FrozenEmbeddingRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH).requires_grad_(False)  # 10.2 MB, frozen
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embedding(ids).mean(dim=1)))  # type: ignore[no-any-return]


def _workload() -> Workload:
    torch.manual_seed(0)
    model = FrozenEmbeddingRegressor()
    generator = torch.Generator().manual_seed(1)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, VOCAB, (size, LENGTH), generator=generator), torch.randn(
            size, 1, generator=generator
        )

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        ids, target = batch
        return nn.functional.mse_loss(model(ids), target), ids.shape[0]

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    return Workload(
        model=model, make_batch=make_batch, loss=loss, optimizer=optimizer, name="frozen-embedding"
    )


def test_planning_a_model_at_60_percent_of_the_budget_holds_one_copy() -> None:
    workload = _workload()
    model = workload.model
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(parameter_bytes / 0.6)
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    with MemoryTracker("cpu", model=model) as outer:
        chosen = plan(workload, batch=32, memory=budget, max_profile_micro_batch_size=8)
    assert chosen.measured_peak_bytes is not None and chosen.measured_peak_bytes <= budget
    # Everything the planner made on the model's device, the model included, stayed within the budget:
    # a second copy of the parameters would alone take them to 120 % of it.
    assert outer.peak_bytes <= budget, (outer.peak_bytes, budget, parameter_bytes)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_preserved_state_restores_an_optimizer_instance_and_grads() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    state = {
        id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    model.eval()
    with preserved_state(model, optimizer=optimizer):
        model.train()
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
        optimizer.state.clear()
    assert not model.training and not model[1].training
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    for parameter, saved in ((p, state[id(p)]) for p in model.parameters()):
        for key, value in saved.items():
            got = optimizer.state[parameter][key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


def test_profiling_extends_to_the_micro_batch_the_search_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    from microbatch.planner import planning as trial

    profiled: list[int] = []
    original = trial.profile_workload

    def spy(workload: Workload, **options: Any) -> Any:
        profile = original(workload, **options)
        profiled.append(max(profile.micro_batch_sizes))
        return profile

    monkeypatch.setattr(trial, "profile_workload", spy)
    chosen = plan(_workload(), batch=64, memory="1GiB", trial=False)
    assert chosen.micro_batch_size == 64  # ample memory: no accumulation
    assert profiled == [16, 64]  # the first profile stops at 16; the choice is then measured


def test_ddp_buckets_are_in_the_refusal_for_two_ranks() -> None:
    workload = _workload()
    trainable = sum(p.numel() * p.element_size() for p in workload.model.parameters() if p.requires_grad)
    parameters = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    # Enough for parameters + gradients on one rank, not with DDP's second copy of the gradients.
    budget = parameters + trainable + trainable // 2
    with pytest.raises(InfeasibleBudgetError, match="DDP gradient buckets") as caught:
        plan(workload, batch=32, memory=budget, world_size=2, trial=False)
    # Parameters, gradients and SGD's momentum (counted before profiling), plus DDP's buckets.
    assert caught.value.minimum_bytes == parameters + 3 * trainable
