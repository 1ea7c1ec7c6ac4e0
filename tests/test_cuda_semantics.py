"""What only a GPU can prove: budgets in reserved bytes, refusals naming both numbers, no host sync.

Every test here is marked gpu and skips without CUDA (the CPU counterparts: test_allocator,
test_host_sync, test_plan_in_place, test_offload).
"""

from __future__ import annotations

import pytest
import torch

from microbatch import Accumulator
from microbatch.errors import ConfigError, InfeasibleBudgetError
from microbatch.models.gpt import GPT, GPTConfig
from microbatch.models.workloads import VarlenTokens, gpt_loss, gpt_optimizer
from microbatch.planner import plan
from microbatch.planner.target.reserve import OUTSIDE_ALLOCATOR
from microbatch.workload import Workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=256, dropout=0.0)


def _workload() -> Workload:
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    tokens = VarlenTokens(block_size=CONFIG.block_size, min_length=CONFIG.block_size, seed=1)
    return Workload(model=model, make_batch=tokens, loss=gpt_loss, optimizer=gpt_optimizer, name="gpt-cuda")


def test_plan_fits_in_reserved_bytes_plus_the_allowance() -> None:
    workload = _workload()
    roomy = plan(workload, batch=32, memory="4GiB", trial=False)
    budget = int(0.6 * roomy.predicted_peak_bytes)  # forces accumulation or checkpointing
    chosen = plan(workload, batch=32, memory=budget)
    parts = dict(chosen.peak_parts)
    assert parts[OUTSIDE_ALLOCATOR] > 0  # the CUDA context at least
    assert chosen.measured_peak_bytes is not None and chosen.measured_peak_bytes <= budget
    assert chosen.cuda_max_allocated_bytes is not None
    assert chosen.measured_peak_bytes >= chosen.cuda_max_allocated_bytes + parts[OUTSIDE_ALLOCATOR]


def test_budget_above_the_device_or_below_the_context_is_refused() -> None:
    workload = _workload()
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ConfigError, match="above the device's total memory"):
        plan(workload, batch=8, memory=total + 2**30)
    with pytest.raises(InfeasibleBudgetError, match="outside the caching allocator"):
        plan(workload, batch=8, memory="1MiB")


def test_fraction_is_of_free_memory_and_said_so() -> None:
    chosen = plan(_workload(), batch=8, memory=0.5, trial=False)
    assert any("free on cuda" in note for note in chosen.notes)


def test_accumulator_with_device_counts_never_syncs_per_micro_batch() -> None:
    workload = _workload()
    model = workload.model
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    batches = [{k: v.cuda() for k, v in workload.make_batch(2).items()} for _ in range(3)]
    for micro in acc.iterate(batches):
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
        try:
            loss, items = workload.loss(model, micro.batch)
            acc.backward(loss, items=items)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if micro.is_last:
            stats = acc.step()
    assert stats.items == 3 * 2 * CONFIG.block_size
