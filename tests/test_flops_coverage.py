"""Every op that computes gets FLOPs in the simulation: an op whose name says it multiplies matrices
(mm, bmm, addmm, convolution, attention, ...) and that the roofline prices at 0 FLOPs fails here.

Under fake CPU tensors SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward, which torch's FLOP registry does not know (issue 20): the roofline maps them itself.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch.models.cnn import IMAGE_SIZE, SmallCNN
from microbatch.models.gpt import GPT, GPTConfig
from microbatch.profile.roofline import op_flops

COMPUTES = re.compile(r"(^|_)(mm|bmm|addmm|baddbmm|matmul|linear|einsum|convolution|attention)")


class _Priced(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if COMPUTES.search(name):
            self.flops[name] = max(self.flops.get(name, 0), op_flops(func, args, kwargs, out))
        return out


def _priced(model: torch.nn.Module, make_input: Any) -> dict[str, int]:
    recorder = _Priced()
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = make_input()
        with recorder:
            out = model(inputs)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    return recorder.flops


def test_every_computing_op_of_a_gpt_and_a_cnn_has_flops() -> None:
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0))
    found = _priced(gpt, lambda: torch.randint(0, 256, (2, 16)))
    assert any("attention" in name for name in found), found  # SDPA ran, and is checked below
    found.update(_priced(SmallCNN(), lambda: torch.randn(2, 1, IMAGE_SIZE, IMAGE_SIZE)))
    unpriced = sorted(name for name, flops in found.items() if flops == 0)
    assert not unpriced, f"ops with FLOPs but no formula: {unpriced}"


def test_cpu_attention_is_priced_as_two_and_five_batched_matmuls() -> None:
    b, h, s, d = 4, 32, 4096, 128
    with FakeTensorMode():
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16)
        forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        out, logsumexp = forward(q, q, q, 0.0, True)
        assert op_flops(forward, (q, q, q, 0.0, True), {}, (out, logsumexp)) == 4 * b * h * s * s * d
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        args = (out, q, q, q, out, logsumexp, 0.0, True)
        assert op_flops(backward, args, {}, backward(*args)) == 10 * b * h * s * s * d


def test_moe_grouped_gemms_are_priced_as_the_routed_rows_matmuls() -> None:
    """transformers' default MoE experts run ``aten._grouped_mm`` (torch's registry has no formula):
    forward, input gradient and weight gradient each cost 2 m k n over the routed rows, so a tiny
    Qwen3-MoE's grouped GEMMs add up to three times the forward's, S = tokens x top-k rows through
    the gate-up (hidden -> 2 x expert width) and down (expert width -> hidden) projections."""
    hf = pytest.importorskip("microbatch.hf")
    batch, seq, hidden, width, top_k, layers = 2, 16, 32, 16, 2, 2
    model = hf.tiny_moe(
        "qwen3_moe", hidden_size=hidden, expert_size=width, top_k=top_k, num_layers=layers,
        experts_implementation="grouped_mm", output_router_logits=False, dtype=torch.bfloat16,
    )  # fmt: skip
    calls: list[int] = []

    class _Grouped(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten._grouped_mm:
                calls.append(op_flops(func, args, kwargs or {}, out))
            return out

    with _Grouped():
        model(input_ids=torch.randint(0, 64, (batch, seq))).logits.float().sum().backward()
    rows = batch * seq * top_k
    forward = layers * (2 * rows * hidden * 2 * width + 2 * rows * width * hidden)
    assert len(calls) == layers * 2 * 3 and all(flops > 0 for flops in calls)
    assert sum(calls) == 3 * forward
