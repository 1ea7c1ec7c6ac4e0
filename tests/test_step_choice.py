"""The exact levers as plan choices (planner/levers/): the optimizer step's implementation and the
loss head in chunks."""

from __future__ import annotations

import copy

import pytest
import torch

import microbatch as mb
from microbatch.errors import ConfigError
from microbatch.memory.device_specs import device_spec
from microbatch.models import GPT, GPTConfig
from microbatch.models.workloads import gpt_loss
from microbatch.planner import Plan, PlanOptions
from microbatch.planner.levers.step_choice import measured_step
from microbatch.planner.result.applying import set_step_, supported_steps
from microbatch.workload import Workload


def _updated(implementation: str | None, dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if implementation is not None:
        set_step_(optimizer, implementation)
    for step in range(3):
        inputs = torch.randn(8, 16, dtype=dtype, generator=torch.Generator().manual_seed(step))
        model(inputs).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("implementation", ["foreach", "fused", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_step_implementation_gives_the_default_update(implementation: str, dtype: torch.dtype) -> None:
    default = _updated(None, dtype)
    chosen = _updated(implementation, dtype)
    # The same arithmetic in another order: a few units of the dtype's rounding (eps 1.2e-7 / 2.2e-16).
    eps = torch.finfo(dtype).eps
    for got, want in zip(chosen, default, strict=True):
        torch.testing.assert_close(got, want, rtol=16 * eps, atol=16 * eps)


def test_step_implementations_are_refused_by_name() -> None:
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    assert supported_steps(optimizer) == ("foreach", "fused", "per-tensor")
    with pytest.raises(ConfigError, match="no step implementation"):
        set_step_(optimizer, "fastest")
    lbfgs = torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ConfigError, match="no fused step"):
        set_step_(lbfgs, "fused")


def _llama_like(vocab: int = 4096, width: int = 64) -> Workload:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=width, block_size=64, vocab_size=vocab))
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (size, 65), generator=generator)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    return Workload(model=model, make_batch=make_batch, loss=gpt_loss, name="wide-vocab-gpt")


def test_simulated_step_temporaries_of_each_implementation() -> None:
    workload = _llama_like(width=256)
    spec = device_spec("rtx4090")
    peaks = {name: _peak(measured_step(workload, spec, name, max_grad_norm=None)) for name in supported_steps(
        workload.make_optimizer())}  # fmt: skip
    parameter_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    # foreach makes AdamW's intermediates for every parameter at once (CUDA's path, simulated); fused
    # none of its own (what remains is the window's gradient norm, common to all three).
    assert peaks["foreach"] >= parameter_bytes
    assert peaks["fused"] < parameter_bytes
    assert peaks["fused"] < min(peaks["foreach"], peaks["per-tensor"])


def test_the_planner_chooses_the_head_in_chunks_and_apply_installs_it(tmp_path: object) -> None:
    # Vocabulary 32,768 x width 32: a row's logits (64 x 32,768 x 4 B = 8 MiB a copy) outweigh the model.
    workload = _llama_like(vocab=32768, width=32)
    with pytest.raises(mb.InfeasibleBudgetError, match="no plan fits"):
        mb.plan(workload, batch=2, memory="34MiB", trial=False, policies=["full"], head=[])
    chosen = mb.plan(workload, batch=2, memory="34MiB", trial=False, policies=["full"], head=[16])
    assert chosen.head_chunk_tokens == 16
    assert chosen.predicted_peak_bytes <= chosen.budget_bytes
    assert "head: chunks of 16 tokens" in str(chosen)
    assert workload.model.head_chunk_tokens is None  # planning leaves the model as it was
    path = f"{tmp_path}/plan.json"
    chosen.save(path)
    loaded = Plan.load(path)
    assert loaded.head_chunk_tokens == 16
    model = copy.deepcopy(workload.model)
    optimizer = torch.optim.AdamW(model.parameters())
    loaded.apply(model, optimizer)
    assert model.head_chunk_tokens == 16
    loaded.remove(model)
    assert model.head_chunk_tokens is None


def test_a_refusal_names_the_exact_levers_before_those_that_change_training() -> None:
    workload = _llama_like(vocab=32768, width=32)
    with pytest.raises(mb.InfeasibleBudgetError) as caught:
        mb.plan(workload, batch=2, memory="30MiB", trial=False, policies=["full"], head=[])
    message = str(caught.value)
    exact, changing = message.index("Exact levers"), message.index("Levers that change the training")
    assert exact < message.index("FSDP over") < changing
    # Exact, named with its saving, but not offered by microbatch (issue 34).
    assert exact < message.index("CPU offload of the optimizer state (not offered by microbatch") < changing
    assert message.index("8-bit optimizer state") > changing
    assert message.count("[changes training]") == 2
    assert caught.value.minimum_bytes > 30 * 2**20


def _peak(found: tuple[int, float] | None) -> int:
    assert found is not None, "the simulated step ran out of memory"
    return found[0]


def test_exact_levers_off_plans_as_before_them() -> None:
    # The comparison issue 34's table draws: the same request without the head's chunks, the step's
    # other implementations, or the levers named in the refusal.
    workload = _llama_like(vocab=32768, width=32)
    with pytest.raises(mb.InfeasibleBudgetError) as caught:
        mb.plan(workload, batch=2, memory="34MiB", trial=False, policies=["full"], exact_levers=False)
    assert "Exact levers" not in str(caught.value)
    assert "[changes training]" not in str(caught.value)
    chosen = mb.plan(workload, batch=2, memory="34MiB", trial=False, policies=["full"], head=[16])
    assert chosen.head_chunk_tokens == 16
    with pytest.raises(ConfigError, match="exact_levers=False"):
        mb.plan(workload, batch=2, memory="34MiB", trial=False, head=[16], exact_levers=False)
    with pytest.raises(ConfigError, match="exact_levers must be True or False"):
        PlanOptions(exact_levers="no")  # type: ignore[arg-type]
