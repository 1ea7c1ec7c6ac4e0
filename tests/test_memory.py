"""Byte sizes, and MemoryTracker against counts made independently of it.

Agreement tolerance with torch's own tracker (torch.distributed._tools.mem_tracker, private API,
used here only as a referee): 2 % of the peak. Exact byte counts where the live tensors are known.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

from microbatch.errors import ConfigError, UsageError
from microbatch.memory import CATEGORIES, MemoryTracker, device_memory_bytes, format_bytes, parse_bytes
from microbatch.memory import budget as memory_module

# --------------------------------------------------------------------------------------------------
# parse_bytes / format_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("300MiB", 300 * 2**20),
        ("1.5G", 1_500_000_000),
        ("2 kb", 2000),
        ("64KiB", 65536),
        ("1e3", 1000),
        ("12", 12),
        (4096, 4096),
        (3.0e9, 3_000_000_000),
        ("1TiB", 2**40),
    ],
)
def test_parse_bytes_units(text: Any, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_fraction_of_free_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    free = 10_000_000
    monkeypatch.setattr(memory_module, "device_free_bytes", lambda device=None: free)
    assert parse_bytes(0.5, device="cpu") == free // 2
    assert parse_bytes("0.25", device="cpu") == free // 4
    assert parse_bytes(1.0, device="cpu") == free
    assert parse_bytes("1.0", device="cpu") == free  # a float in (0, 1]: a fraction
    assert parse_bytes("5e-1", device="cpu") == free // 2
    assert parse_bytes("80%", device="cpu") == free * 8 // 10
    assert parse_bytes("100%", device="cpu") == free
    assert parse_bytes(1) == 1 and parse_bytes("1") == 1  # integers are bytes
    assert parse_bytes(2.0) == 2 and parse_bytes("0.5KiB") == 512  # a unit makes it bytes


def test_device_free_bytes_is_at_most_the_total() -> None:
    assert 0 < memory_module.device_free_bytes("cpu") <= device_memory_bytes("cpu")


@pytest.mark.parametrize("bad", ["1.5", 1.5, "1.5B", "150%", "0%", "-5%", "x%", "inf", "1e400"])
def test_parse_bytes_refuses_fractional_bytes_and_bad_percentages(bad: Any) -> None:
    with pytest.raises(ConfigError, match="memory"):
        parse_bytes(bad, name="memory")


@pytest.mark.parametrize("bad", ["abc", "8 parsecs", "-1GiB", 0, -5, True, float("nan"), 0.0, "0", None])
def test_parse_bytes_rejects_nonsense_naming_the_argument(bad: Any) -> None:
    with pytest.raises(ConfigError, match="budget"):
        parse_bytes(bad, name="budget")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (150 * 2**20, "150 MiB"),
        (5 * 2**30, "5.00 GiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize("num_bytes", [1, 999, 4096, 123_456_789, 7 * 2**40])
def test_format_then_parse_round_trips_to_three_digits(num_bytes: int) -> None:
    text = format_bytes(num_bytes).replace(" ", "")
    assert parse_bytes(text) == pytest.approx(num_bytes, rel=5e-3)


# --------------------------------------------------------------------------------------------------
# MemoryTracker: exact counts


def test_views_and_shared_storages_count_once() -> None:
    with MemoryTracker(device="cpu") as mem:
        base = torch.zeros(1000)  # 4000 bytes
        views = [base[10:], base.view(10, 100), base.view(10, 100).t()]
        alias = torch.as_strided(base, (10,), (2,))
        assert mem.current_bytes == 4000
        del views, alias
        other = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert mem.current_bytes == 6000
        del base
        assert mem.current_bytes == 2000
        del other
    assert mem.peak_bytes == 6000
    assert mem.breakdown == {**dict.fromkeys(CATEGORIES, 0), "temporaries": 6000}
    assert mem.current_bytes == 0


def test_known_model_and_step_by_category() -> None:
    """Linear(64, 64) without bias on 4 rows, first Adam step: the peak is inside step()."""
    model = nn.Linear(64, 64, bias=False)
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.randn(4, 64)
    weight_bytes, input_bytes = 64 * 64 * 4, 4 * 64 * 4
    with MemoryTracker(device="cpu", model=model, optimizer=optimizer) as mem:
        mem.track(x)
        assert mem.current_bytes == weight_bytes + input_bytes
        model(x).square().sum().backward()
        optimizer.step()
    # at the peak: weight, its gradient, Adam's exp_avg and exp_avg_sq (made inside step(), recognised
    # as optimizer state when step() ends), x, and step()'s temporaries
    assert mem.breakdown["parameters"] == weight_bytes
    assert mem.breakdown["gradients"] == weight_bytes
    assert mem.breakdown["optimizer state"] == 2 * weight_bytes + 4  # + the float32 step counter
    assert mem.breakdown["other"] + mem.breakdown["saved activations"] == input_bytes
    assert mem.peak_bytes == sum(mem.breakdown.values())
    assert mem.breakdown["temporaries"] >= weight_bytes  # sqrt(exp_avg_sq) at least


def test_saved_activations_are_counted_as_such() -> None:
    x = torch.randn(100, 10, requires_grad=True)
    with MemoryTracker(device="cpu") as mem:
        y = x.exp()  # exp saves its output: 4000 bytes
        z = y.sum()
    assert mem.breakdown["saved activations"] == 4000
    z.backward()


def test_parameters_found_without_being_told_and_their_grads() -> None:
    model = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with MemoryTracker(device="cpu") as mem:
        model(x).sum().backward()
    assert mem.breakdown["parameters"] == (16 * 16 + 16) * 4
    with MemoryTracker(device="cpu") as mem:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        model(x).sum().backward()  # second backward accumulates in place: no new gradient storage
    assert mem.breakdown["gradients"] == (16 * 16 + 16) * 4


def test_other_devices_are_not_counted() -> None:
    with MemoryTracker(device="meta") as mem:
        _ = torch.ones(1000)
    assert mem.peak_bytes == 0
    assert mem.cuda_max_allocated_bytes is None and mem.cuda_max_reserved_bytes is None


def test_report_and_dict() -> None:
    model = nn.Linear(8, 8)
    with MemoryTracker(device="cpu", model=model) as mem:
        model(torch.randn(2, 8)).sum().backward()
    text = str(mem)
    assert "peak live tensor memory on cpu" in text
    for category in CATEGORIES:
        assert category in text
    data = json.loads(json.dumps(mem.to_dict()))
    assert data["peak_bytes"] == mem.peak_bytes
    assert data["breakdown"] == mem.breakdown


def test_misuse() -> None:
    mem = MemoryTracker(device="cpu")
    with pytest.raises(ConfigError, match="category"):
        mem.track(torch.ones(1), category="weights")
    with mem, pytest.raises(UsageError, match="already active"), mem:
        pass


# --------------------------------------------------------------------------------------------------
# MemoryTracker against torch's own tracker


def mlp() -> nn.Module:
    return nn.Sequential(
        *(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(4)
        )
    )


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("step_number", [1, 2])
def test_agrees_with_torch_mem_tracker(step_number: int) -> None:
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 32)
    for _ in range(step_number - 1):  # step 2: optimizer state exists before the span
        training_step(model, optimizer, x)
    twin_model = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin_model.parameters())
    twin_optimizer.load_state_dict(optimizer.state_dict())

    with MemoryTracker(device="cpu", model=model, optimizer=optimizer) as mem:
        mem.track(x)
        training_step(model, optimizer, x)
    referee = mem_tracker.MemTracker()
    referee.track_external(twin_model, twin_optimizer, x)
    with referee:
        training_step(twin_model, twin_optimizer, x)
    reference_peak = referee.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert mem.peak_bytes == pytest.approx(reference_peak, rel=0.02)
    if step_number == 2:  # state made by the first step is counted from the start
        adam_state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())
        assert mem.breakdown["optimizer state"] >= adam_state_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_bracket_the_live_tensor_peak() -> None:
    model = mlp().cuda()
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(1024, 32, device="cuda")
    torch.cuda.synchronize()
    with MemoryTracker(model=model, optimizer=optimizer) as mem:
        mem.track(x)
        training_step(model, optimizer, x)
    assert mem.cuda_max_allocated_bytes is not None and mem.cuda_max_reserved_bytes is not None
    assert mem.cuda_max_reserved_bytes >= mem.cuda_max_allocated_bytes
    # allocator peak = tracked tensors + whatever lived on the device before (cuBLAS workspace, ...)
    assert mem.peak_bytes <= mem.cuda_max_allocated_bytes
    assert mem.peak_bytes >= 0.5 * mem.cuda_max_allocated_bytes


# -- the tracker's device comes from what it tracks, not from whether a GPU exists ------------------


@pytest.fixture
def pretend_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine, as far as a default device choice can tell (nothing may really touch CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_tracker_device_from_model_on_gpu_machine(pretend_cuda_exists: None) -> None:
    model = torch.nn.Linear(64, 64)
    with MemoryTracker(model=model) as tracker:
        model(torch.randn(8, 64)).sum().backward()
    assert tracker.device == torch.device("cpu")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert tracker.breakdown["parameters"] == parameter_bytes
    assert tracker.peak_bytes >= 2 * parameter_bytes  # parameters and their gradients


def test_tracker_device_from_first_tensor_on_gpu_machine(pretend_cuda_exists: None) -> None:
    with MemoryTracker() as tracker:
        x = torch.ones(1000)
        y = x * 2
    assert tracker.device == torch.device("cpu")
    assert tracker.peak_bytes >= 2 * 4000
    del x, y
