"""A Megatron-style GPT layer measured under fake tensors against Korthikanti et al.'s formula.

Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models), section 4.1,
count the activations one layer keeps for backward, in bytes, with 16-bit activations and 1-byte
dropout masks: attention 11 sbh + 5 a s^2 b, MLP 19 sbh, the two LayerNorms 4 sbh; in all
sbh (34 + 5 a s / h). The layer below is theirs: pre-LayerNorm, Q/K/V projections, softmax of the
scores, dropout of the probabilities, output projection and dropout, 4h GeLU MLP and dropout.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from microbatch.memory.device_specs import devices
from microbatch.profile.costs import NONE
from microbatch.profile.simulate import simulate_profile
from microbatch.workload import Workload

S, B, H, A = 128, 2, 256, 4  # sequence, micro-batch, hidden, heads: 5 a s / h = 10


class MegatronLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape  # Megatron's [s, b, h] layout
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [b * a, s, h / a]
            return t.reshape(s, b * self.heads, h // self.heads).transpose(0, 1)

        scores = torch.bmm(heads(q), heads(k).transpose(1, 2)) / math.sqrt(h // self.heads)
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        context = torch.bmm(probs, heads(v)).transpose(0, 1).reshape(s, b, h)
        x = x + F.dropout(self.proj(context), self.dropout, self.training)
        hidden = F.gelu(self.fc1(self.norm2(x)))
        return x + F.dropout(self.fc2(hidden), self.dropout, self.training)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(H, A) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _kept_by_second_layer(target: str) -> float:
    model = Stack().to(torch.float16)
    workload = Workload(
        model=model,
        # The planner wants samples on dim 0; the layer wants Megatron's [s, b, h].
        make_batch=lambda b: torch.randn(b, S, H, dtype=torch.float16),
        loss=lambda m, x: (m(x.transpose(0, 1)).float().pow(2).mean(), int(x.shape[0])),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    )
    spec = devices()[target].replace(context_bytes=0)
    profile = simulate_profile(workload, spec, micro_batch_sizes=[B], policies=[NONE])
    # The second layer's input comes from a layer, as in the middle of a model. What a layer keeps
    # is what autograd saved in it plus its output (the next layer's LayerNorm input), while its own
    # input was counted by the layer before: per layer, the formula's terms.
    return profile.blocks[1].costs[NONE].kept(B)


def test_megatron_layer_matches_korthikanti_within_5_percent() -> None:
    formula = S * B * H * (34 + 5 * A * S / H)
    measured = _kept_by_second_layer("a100-80gb")
    # Measured: +0.07 %. The difference is the LayerNorms' saved mean and rstd (one value each per
    # token per LayerNorm), which the formula leaves out. The 1-byte dropout masks are CUDA's fused
    # dropout (torch.native_dropout), which a CUDA target simulates.
    assert measured == pytest.approx(formula, rel=0.05), (measured, formula)
    assert measured >= formula


def test_cpu_dropout_masks_are_two_bytes() -> None:
    # The CPU's dropout saves its mask in the input's dtype (2 bytes here): the attention dropout's
    # a s^2 b elements and the two s b h masks after the projections each cost one byte more.
    difference = _kept_by_second_layer("cpu") - _kept_by_second_layer("a100-80gb")
    assert difference == A * S * S * B + 2 * S * B * H
