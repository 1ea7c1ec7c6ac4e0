"""The planner's peak on real transformers mixtures of experts (issue 36, Done-when 1).

Tiny Qwen3-MoE and Mixtral configs (8 experts, top-2, expert width 128, transformers' eager expert
loop): profiled at micro-batches 1, 2 and 4 of 64 tokens, the plan's peak (less its 1 % margin) at
micro-batches 2, 4 and 8 is the peak a MemoryTracker outside the planner measures over real training
windows, within 5 %, under a balanced router and a collapsed one.

The eager loop runs one expert at a time on the tokens routed to it (``nonzero`` on the routing mask),
so the memory depends on the routing; the profile measures the model's own routing on the workload's
batches. Balanced: the routers' weights drawn from N(0, 1), every expert hit. Collapsed: the weights
zero, every token's probabilities tie and topk sends every token to the same two experts. The routers
are frozen so the optimizer's steps keep the routing the profile saw. Every plan's notes say which
routing its peak assumed (profile/routing.py, with the numbers when the routing changes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import microbatch as mb
from microbatch import hf
from microbatch.hf.causal_lm import causal_lm_workload
from microbatch.profile import NONE, Profile, profile_workload
from microbatch.profile.routing import routing_note
from microbatch.workload import Workload
from test_plan_referee import referee_peaks  # every window's peak under a tracker of its own

pytest.importorskip("transformers")

SEQ, VOCAB, EXPERTS, TOP_K = 64, 64, 8, 2
PROFILED, PLANNED = (1, 2, 4), (2, 4, 8)
TOLERANCE = 0.05
ROUTING_NOTE = f"mixture of experts ({EXPERTS} experts, top-{TOP_K}): the peak was measured on the routing"


def _routers(model: torch.nn.Module) -> list[Any]:
    """Each layer's router (Qwen3-MoE's ``mlp.gate``, Mixtral's ``mlp.gate`` / ``block_sparse_moe.gate``)."""
    modules = model.named_modules()
    return [module for name, module in modules if name.endswith(".gate") and hasattr(module, "top_k")]


def _set_routing_(model: torch.nn.Module, routing: str) -> None:
    generator = torch.Generator().manual_seed(1)
    for router in _routers(model):
        with torch.no_grad():
            if routing == "collapsed":
                router.weight.zero_()
            else:
                router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.weight.requires_grad_(False)


def _expert_loads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Tokens routed to each expert, per layer, for one forward of ``batch``."""
    loads: list[list[int]] = []

    def count(module: Any, args: Any, output: Any) -> None:
        loads.append(torch.bincount(output[2].flatten(), minlength=EXPERTS).tolist())

    hooks = [router.register_forward_hook(count) for router in _routers(model)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return loads


def test_only_a_mixture_of_experts_gets_the_routing_note() -> None:
    assert routing_note(hf.tiny_llama()) is None
    assert routing_note(torch.nn.Linear(2, 2)) is None
    note = routing_note(hf.tiny_moe("mixtral", num_experts=4, top_k=1))
    assert note is not None and note.startswith("mixture of experts (4 experts, top-1)")


def _moe_workload(family: str, routing: str) -> Workload:
    """A tiny ``family`` MoE under ``routing`` on 64-token rows of random ids (every token attended)."""
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "num_experts": EXPERTS, "top_k": TOP_K, "expert_size": 128}
    model = hf.tiny_moe(family, vocab_size=VOCAB, **sizes)
    _set_routing_(model, routing)
    generator = torch.Generator().manual_seed(1)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (size, SEQ), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    return causal_lm_workload(
        model,
        make_batch,
        optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3),
    )


def _error(workload: Workload, profile: Profile, size: int) -> float:
    """(predicted - measured) / measured for one micro-batch of ``size``, the tracker's last window."""
    plan = mb.plan(workload, batch=size, memory="1GiB", profile=profile, policies=[NONE], trial=False)
    assert plan.micro_batch_sizes == (size,)
    assert any(note.startswith(ROUTING_NOTE) for note in plan.notes), plan.notes
    predicted = plan.predicted_peak_bytes - dict(plan.peak_parts)["safety margin (1%)"]
    peaks = referee_peaks(workload, plan, {})  # from the second window on, the optimizer's state is held
    return (predicted - peaks[-1]) / peaks[-1]


@pytest.mark.parametrize("routing", ["balanced", "collapsed"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_predicted_peak_is_the_measured_one(family: str, routing: str, one_torch_thread: None) -> None:
    workload = _moe_workload(family, routing)
    loads = _expert_loads(workload.model, workload.make_batch(4))
    assert len(loads) == 2 and all(sum(layer) == 4 * SEQ * TOP_K for layer in loads)
    if routing == "collapsed":  # every token on the same two experts
        assert all(sorted(layer)[-TOP_K:] == [4 * SEQ] * TOP_K for layer in loads), loads
    else:  # every expert hit, none over twice its even share
        assert all(0 < load <= 2 * 4 * SEQ * TOP_K / EXPERTS for layer in loads for load in layer), loads
    profile = profile_workload(workload, micro_batch_sizes=PROFILED, policies=[NONE], repeats=1)
    errors = {size: _error(workload, profile, size) for size in PLANNED}
    assert all(abs(error) <= TOLERANCE for error in errors.values()), (family, routing, errors)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_another_routing_moves_the_peak_past_the_tolerance(family: str, one_torch_thread: None) -> None:
    """Why the note: profiled under a balanced router, the plan is over a collapsed router's peak by more
    than 5 % at micro-batch 2 (measured 10.6 % Qwen3-MoE, 11.1 % Mixtral): 8 experts hit, not 2, and
    backward gives each hit expert's index into the stacked weights a gradient of the whole stack."""
    workload = _moe_workload(family, "balanced")
    profile = profile_workload(workload, micro_batch_sizes=PROFILED, policies=[NONE], repeats=1)
    _set_routing_(workload.model, "collapsed")
    error = _error(workload, profile, 2)
    assert TOLERANCE < error < 0.2, (family, error)
