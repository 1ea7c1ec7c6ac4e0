"""selective-half: torchtitan's op-level selective policy (every second projection saved).

Each test states its reference: the uncheckpointed float64 gradient, a hand count of the saved
outputs from the layer's shapes, or FlopCounterMode's count of the one projection rerun.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import microbatch as mb
from microbatch.hf.configs import ModelSetup, simulate_config_profile
from microbatch.memory import MemoryTracker
from microbatch.memory.device_specs import devices

TOL = {"rtol": 1e-10, "atol": 1e-12}
WIDTH, BATCH = 8, 32
OUTS = (16, 24, 40, WIDTH)  # the four projections' output widths, all different


class FourProjections(nn.Module):
    """x + P4(tanh(P3(tanh(P2(tanh(P1 x)))))): four projections, the third with a bias (addmm)."""

    def __init__(self) -> None:
        super().__init__()
        widths = (WIDTH, *OUTS)
        self.proj = nn.ModuleList(nn.Linear(widths[i], widths[i + 1], bias=i == 2) for i in range(len(OUTS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for index, projection in enumerate(self.proj):
            h = projection(h)
            if index < len(self.proj) - 1:
                h = torch.tanh(h)
        return x + h


def _model(depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(FourProjections() for _ in range(depth))).double()


def _kept_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with MemoryTracker(device="cpu", model=model) as mem:
        loss = model(x).square().sum()
        kept = mem.current_bytes
        loss.backward()
    return kept


def test_gradients_equal_the_uncheckpointed_model_in_float64() -> None:
    reference = _model()
    model = copy.deepcopy(reference)
    handle = mb.checkpoint(model, blocks=["0", "1", "2"], policy="selective-half")
    for step in range(3):  # gradients accumulate over the steps, as in a window
        x = torch.randn(BATCH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    handle.remove()


def test_keeps_the_first_and_third_projection_by_hand_count() -> None:
    """Each block keeps its input (WIDTH) and the outputs of projections 1 and 3 (16 + 40) per row
    under selective-half; selective keeps projections 1-3 (it learns that the recompute never
    reruns the 4th); full keeps the input only. Float64: 8 bytes. Every step, from the first:
    selective-half learns nothing."""
    depth, x = 3, torch.randn(BATCH, WIDTH, dtype=torch.float64)
    kept = {}
    for policy in ("full", "selective", "selective-half"):
        model = _model(depth)
        handle = mb.checkpoint(model, blocks=["0", "1", "2"], policy=policy)
        runs = [_kept_after_forward(model, x) for _ in range(3)]
        handle.remove()
        if policy == "selective-half":
            assert runs[0] == runs[1] == runs[2]
        kept[policy] = runs[-1]
    row = depth * BATCH * 8
    assert kept["selective-half"] - kept["full"] == row * (OUTS[0] + OUTS[2])
    assert kept["selective"] - kept["full"] == row * (OUTS[0] + OUTS[1] + OUTS[2])


def test_reruns_the_second_projection_only() -> None:
    """The recompute reruns projection 2 (2 * rows * 16 * 24 FLOPs per block) and stops before
    projection 4, whose output nothing in backward needs (torch's early stop)."""
    depth, x = 3, torch.randn(BATCH, WIDTH, dtype=torch.float64)
    model = _model(depth)

    def flops() -> int:
        with FlopCounterMode(display=False) as counter:
            model(x).square().sum().backward()
        return int(counter.get_total_flops())

    baseline = flops()
    with mb.checkpoint(model, blocks=["0", "1", "2"], policy="selective-half"):
        half = flops()
    assert half - baseline == depth * 2 * BATCH * OUTS[0] * OUTS[1]


@pytest.mark.slow
def test_simulated_llama_layer_keeps_the_hand_counted_bytes() -> None:
    """llama-3.1-8b at micro-batch 2 x seq 8192 in bf16 (t = 16,384 tokens, d 4096, d_kv 1024,
    d_ff 14336, 32 heads), simulated for an H100: a selective-half layer keeps its input (t d),
    q (t d), v (t d_kv), the attention output (t d) and its log-sum-exp (b h s, fp32), gate (t d_ff)
    and down (t d): 994 MiB; selective also keeps k, o and up and not down: 1,474 MiB."""
    b, s, d, d_kv, d_ff, heads = 2, 8192, 4096, 1024, 14336, 32
    tokens, bf16 = b * s, 2
    lse = b * heads * s * 4
    half = tokens * bf16 * (d + d + d_kv + d + d_ff + d) + lse
    selective = tokens * bf16 * (d + d + d_kv + d_kv + d + d + d_ff + d_ff) + lse
    spec = devices()["h100-80gb"].replace(memory_bytes=2**40)
    _, profile = simulate_config_profile(
        "llama-3.1-8b",
        ModelSetup(seq_len=s, precision="bf16"),
        spec,
        max_micro_batch_size=b,
        policies=["selective", "selective-half"],
    )
    layer = next(segment for segment in profile.segments if segment.is_block)
    kept = {policy: layer.costs[policy].kept_bytes(b) for policy in ("selective", "selective-half")}
    # The simulation's kept bytes beyond the hand count: the few scalars a layer saves (RNG seeds
    # and offsets of the attention kernel), under 1 KiB.
    assert 0 <= kept["selective-half"] - half < 1024
    assert 0 <= kept["selective"] - selective < 1024
