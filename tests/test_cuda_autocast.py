"""``torch.autocast("cuda", ...)`` in a workload simulated for a GPU runs with CUDA autocast's lists
(profile/cuda_autocast.py): matmuls in bfloat16, softmax / layer_norm / exp in float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch.memory.device_specs import devices
from microbatch.profile.simulate import simulation

H100 = devices()["h100-80gb"]
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class _Attention(nn.Module):
    """Attention written out (softmax of the scores, as nanoGPT's non-flash path), then a norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        out: torch.Tensor = self.head(self.norm(scores.softmax(dim=-1) @ v))
        return out


class _Dtypes(TorchDispatchMode):
    """The dtype of every op's tensor output, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            self.seen.setdefault(func._overloadpacket.__name__, set()).add(first.dtype)
        return out


def _simulate(
    autocast: bool, *, batch: int = 8, seq_len: int = 512, width: int = 1024
) -> tuple[_Dtypes, float]:
    """One forward and backward simulated on an H100: the dtypes seen and the roofline seconds."""
    model = _Attention(width)
    with simulation(model, H100) as (_, clock):
        x = torch.empty(batch, seq_len, width)
        target = torch.zeros(batch * seq_len, dtype=torch.long)
        dtypes = _Dtypes()
        began = clock.seconds
        with dtypes:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(x).flatten(0, 1), target)
                exp = loss.exp()
            loss.backward()
        seconds = clock.seconds - began
        del exp
    return dtypes, seconds


def test_cuda_autocast_in_a_workload_is_honoured_with_cuda_lists() -> None:
    dtypes, mixed_seconds = _simulate(autocast=True)
    forward = {name: kinds for name, kinds in dtypes.seen.items() if "backward" not in name}
    # Lower precision (CUDA's and CPU's lists alike): every matmul of the forward in bfloat16.
    assert {"addmm", "bmm"} <= set(forward)
    assert all(forward[name] == {torch.bfloat16} for name in MATMULS & set(forward))
    # Float32 on CUDA, where CPU autocast would keep the 16-bit input's dtype: softmax, layer_norm, exp.
    assert forward["_softmax"] == {torch.float32}
    assert forward["native_layer_norm"] == {torch.float32}
    assert forward["exp"] == {torch.float32}
    # Without autocast everything is float32, and the matmuls run at the fp32 rate: the roofline's
    # bf16 / fp32 peak ratio for an H100 is over 10, so the step is far faster under autocast.
    fp32_dtypes, fp32_seconds = _simulate(autocast=False)
    assert all(kinds == {torch.float32} for name, kinds in fp32_dtypes.seen.items() if name in MATMULS)
    assert mixed_seconds < 0.5 * fp32_seconds


def test_autocast_is_left_alone_outside_the_simulation() -> None:
    # On this machine (no GPU) torch.autocast("cuda") disables itself, as it did before.
    with pytest.warns(UserWarning, match="CUDA"):
        region = torch.autocast("cuda", dtype=torch.bfloat16)
    with region:
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_code_that_asks_whether_cuda_autocast_is_on_is_told_so() -> None:
    model, original = nn.Linear(4, 4), torch.is_autocast_enabled
    with simulation(model, H100):
        assert not torch.is_autocast_enabled("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cuda") and torch.is_autocast_enabled()
            assert torch.get_autocast_dtype("cuda") == torch.bfloat16
            with torch.autocast("cuda"):  # nested without a dtype: the enclosing region's, as on CUDA
                assert model(torch.empty(2, 4)).dtype == torch.bfloat16
            with torch.autocast("cuda", enabled=False):
                assert not torch.is_autocast_enabled("cuda")
                assert model(torch.empty(2, 4)).dtype == torch.float32
        assert not torch.is_autocast_enabled("cuda")
    assert torch.is_autocast_enabled is original  # put back after the simulation
