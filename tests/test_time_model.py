"""The planner's time model: its arithmetic, which timed run a profile keeps, and the clocks."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

from microbatch.checkpointing.api import find_blocks
from microbatch.errors import ConfigError
from microbatch.memory.device_specs import DeviceSpec, devices
from microbatch.planner.search.sizes import Model
from microbatch.profile import NONE, Fit, PolicyCost, Profile, SegmentProfile, profile_workload
from microbatch.profile.assemble import fastest_runs
from microbatch.profile.clocks import clock_for
from microbatch.profile.roofline import RooflineClock, all_gather_seconds, all_reduce_seconds
from microbatch.profile.runs import micro_batch_run
from microbatch.profile.timeline import Run, SegmentRun
from test_profile import mlp_workload

STEP, LOOP_FIXED, LOOP_PER_SAMPLE = 0.5, 0.01, 0.001
# Per segment: (forward a, forward k, backward a, backward k) in seconds, a + k * b.
LINES = {
    "(before blocks)": (0.1, 0.01, 0.2, 0.02),
    "block": (1.0, 0.1, 2.0, 0.2),
    "(after blocks)": (0.3, 0.0, 0.4, 0.0),
}
FULL_BACKWARD = (3.0, 0.3)  # the block's backward with its recompute under "full"


def _cost(forward: tuple[float, float], backward: tuple[float, float]) -> PolicyCost:
    zero = Fit.constant(0)
    return PolicyCost(
        kept_bytes=zero,
        peak_bytes=zero,
        forward_seconds=Fit(*forward),
        backward_seconds=Fit(*backward),
    )


def _profile() -> Profile:
    segments = []
    for name, (fa, fk, ba, bk) in LINES.items():
        costs = {NONE: _cost((fa, fk), (ba, bk))}
        if name == "block":
            costs["full"] = _cost((fa, fk), FULL_BACKWARD)
        segments.append(SegmentProfile(name=name, is_block=name == "block", costs=costs))
    return Profile(
        name="synthetic",
        device="cpu",
        micro_batch_sizes=(1, 8, 16),
        segments=tuple(segments),
        parameter_bytes=0,
        gradient_bytes=0,
        optimizer_bytes=0,
        optimizer_name="SGD",
        base_bytes=Fit.constant(0),
        step_peak_bytes=0,
        step_seconds=STEP,
        loop_seconds=Fit(LOOP_FIXED, LOOP_PER_SAMPLE),
    )


def _by_hand(sizes: list[int], *, full: bool) -> float:
    """sum over micro-batches of (loop + every segment's forward and backward) + one step."""
    total = STEP
    for m in sizes:
        total += LOOP_FIXED + LOOP_PER_SAMPLE * m
        for name, (fa, fk, ba, bk) in LINES.items():
            if full and name == "block":
                ba, bk = FULL_BACKWARD
            total += fa + fk * m + ba + bk * m
    return total


@pytest.mark.parametrize("sizes", [[64], [8] * 8, [22, 22, 20], [1] * 64])
@pytest.mark.parametrize("full", [False, True])
def test_the_step_is_counted_once_per_window(sizes: list[int], full: bool) -> None:
    candidate = Model(_profile()).evaluate(sizes, {"block": "full"} if full else {})
    assert candidate.seconds_per_step == pytest.approx(_by_hand(sizes, full=full), rel=1e-12)
    # Splitting the same samples finer adds the per-micro-batch intercepts, never another step.
    one = Model(_profile()).evaluate([sum(sizes)], {}).seconds_per_step
    fixed = LOOP_FIXED + sum(fa + ba for fa, _, ba, _ in LINES.values())
    assert Model(_profile()).evaluate(sizes, {}).seconds_per_step - one == pytest.approx(
        (len(sizes) - 1) * fixed, rel=1e-9
    )


def _run(seconds: float, segment_seconds: dict[str, float]) -> Run:
    segments = {name: SegmentRun(value, 2 * value, 0, 0) for name, value in segment_seconds.items()}
    return Run(segments, 0, 0, seconds, True, ("block",), {})


def test_the_fastest_round_is_kept_whole() -> None:
    slow_block = _run(3.0, {"block": 0.9, "rest": 0.1})
    fast = _run(2.0, {"block": 0.5, "rest": 0.4})  # its "rest" is the slowest of all rounds
    slow_rest = _run(2.5, {"block": 0.6, "rest": 0.05})
    chosen = fastest_runs({(NONE, 4): [slow_block, fast, slow_rest], ("full", 4): [slow_rest]})
    # Whole runs, not each segment's minimum (0.5 + 0.05 would be less than any run took).
    assert chosen == {(NONE, 4): fast, ("full", 4): slow_rest}


class _FakeClock:
    """A clock that advances 1 ms per reading; making a batch jumps it by 100 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_a_micro_batch_is_timed_from_its_batch_in_hand() -> None:
    clock = _FakeClock()
    workload = mlp_workload()
    make_batch = workload.make_batch

    def slow_batch(size: int) -> Any:
        clock.now += 100.0  # the data pipeline's time: not the plan's
        return make_batch(size)

    workload.make_batch = slow_batch  # type: ignore[method-assign]
    blocks = find_blocks(workload.model, "auto")
    optimizer = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    run = micro_batch_run(
        workload, blocks, 4, torch.device("cpu"), track=False, optimizer=optimizer, clock=clock
    )
    assert 0 < run.seconds < 1.0
    covered = sum(s.forward_seconds + s.backward_seconds for s in run.segments.values())
    assert covered <= run.seconds


def test_clocks() -> None:
    cpu = torch.device("cpu")
    assert clock_for("wall", cpu) is time.perf_counter
    with pytest.raises(ConfigError, match="clock must be one of"):
        clock_for("gpu", cpu)
    with pytest.raises(ConfigError, match="model is on meta"):
        clock_for("cpu", torch.device("meta"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(ConfigError, match=r"torch\.set_num_threads"):
            clock_for("cpu", cpu)
        torch.set_num_threads(1)
        assert clock_for("cpu", cpu) is time.thread_time
        profile = profile_workload(mlp_workload(), micro_batch_sizes=[1, 4], policies=["none"], clock="cpu")
    finally:
        torch.set_num_threads(threads)
    assert profile.clock == "cpu" and profile.to_dict()["clock"] == "cpu"
    assert profile.step_seconds > 0


def test_times_run_through_the_measurements_and_beyond_along_the_line() -> None:
    sizes, values = [1, 8, 16], [9.0, 42.0, 88.0]  # a noisy 16 pulls the line's value at 1
    fit = Fit.of(sizes, values, nonnegative=True, interpolate=True, line_beyond=True)
    line = Fit.of(sizes, values, nonnegative=True)
    assert line(1) != pytest.approx(9.0, rel=0.05)
    for size, value in zip(sizes, values, strict=True):
        assert fit(size) == pytest.approx(value)
    assert fit(12) == pytest.approx(42.0 + (88.0 - 42.0) * 4 / 8)
    # Beyond the profiled sizes: from the nearest measurement along the least-squares slope.
    assert fit.slope == pytest.approx(line.slope)
    assert fit(64) == pytest.approx(88.0 + line.slope * 48)
    assert fit.to_dict()["line_beyond"] is True


# --- The roofline on achieved rates per op class (issue 20) -------------------------------------


def test_a_big_matmul_runs_at_the_achieved_matmul_rate() -> None:
    spec = devices()["h100-80gb"]
    m = k = n = 8192
    with FakeTensorMode():
        a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
        with RooflineClock(spec) as clock:
            a @ b
    flops = 2 * m * k * n
    achieved = spec.flops_bf16 * 792.1 / 989  # ml-engineering's MAMF of the H100 SXM: 80.1 % of peak
    assert spec.matmul_flops(torch.bfloat16) == pytest.approx(achieved)
    # Compute-bound: 1.1e12 FLOPs over 792 TFLOP/s (1.39 ms) against 402 MB over 2.8 TB/s (0.14 ms).
    assert clock.seconds == pytest.approx(flops / achieved + spec.launch_seconds)
    assert clock.seconds > flops / spec.flops_bf16 * 1.2  # slower than the bare peak said


@pytest.mark.parametrize("causal", [False, True])
def test_attention_runs_at_the_attention_rate_causal_counted_half(causal: bool) -> None:
    spec = devices()["h100-80gb"]
    b, h, s, d = 1, 32, 4096, 128
    with FakeTensorMode():
        q, k, v = (torch.empty(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
        with RooflineClock(spec) as clock:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert clock.ops == 1
    flops = 4 * b * h * s * s * d  # QK^T and PV, torch's formula: the full square
    assert clock.flops == flops
    work = flops / 2 if causal else flops  # FlashAttention's rates count causal FLOPs as half
    assert spec.attention_flops(torch.bfloat16) == 335e12  # FlashAttention-2 on H100
    assert clock.seconds == pytest.approx(work / 335e12 + spec.launch_seconds)
    # float32 attention has no FlashAttention kernel: the matmul's achieved rate.
    assert spec.attention_flops(torch.float32) == spec.matmul_flops(torch.float32)


def test_a_memory_bound_op_moves_its_bytes_at_the_achieved_bandwidth() -> None:
    spec = devices()["a100-80gb"]
    with FakeTensorMode():
        x, y = torch.empty(2**24, dtype=torch.bfloat16), torch.empty(2**24, dtype=torch.bfloat16)
        with RooflineClock(spec) as clock:
            x + y
    moved = 3 * 2 * 2**24  # two inputs read, one output written
    assert clock.flops == 0
    expected = moved / (spec.memory_bytes_per_second * 0.84) + spec.launch_seconds
    assert clock.seconds == pytest.approx(expected)


def test_collectives_run_at_the_nccl_bus_bandwidth_within_and_across_nodes() -> None:
    h100, a100 = devices()["h100-80gb"], devices()["a100-80gb"]
    n = 16 * 10**9
    # Within a node: NVLink's measured bus bandwidth, not its 450 / 300 GB/s line rate.
    assert all_gather_seconds(n, 8, h100) == pytest.approx(7 / 8 * n / 370e9)
    assert all_gather_seconds(n, 8, a100) == pytest.approx(7 / 8 * n / 230e9)
    # Across DGX A100 nodes the InfiniBand ring (192 GB/s busbw) is the slower link.
    assert all_reduce_seconds(n, 64, a100) == pytest.approx(2 * 63 / 64 * n / 192e9)
    # H100 nodes with 8 x 400 Gb/s: the network (384) is faster than NVLink (370), NVLink bounds.
    assert h100.collective_bytes_per_second(128) == 370e9


def test_every_preset_cites_its_achieved_rates() -> None:
    for name, spec in devices().items():
        assert spec.rates_source, name
        stated = (
            spec.matmul_efficiency != 1
            or spec.attention_flops_per_second
            or spec.memory_efficiency != 1
            or spec.bus_bytes_per_second
        )
        if stated:  # each figure names where it was published
            assert re.search(r"arXiv:\d{4}\.\d{5}", spec.rates_source), name
            assert re.search(r"\d+ %", spec.rates_source), name
            if spec.matmul_efficiency != 1 and spec.attention_flops_per_second:
                assert "ml-engineering" in spec.rates_source, name  # MAMF
            if spec.bus_bytes_per_second:
                assert re.search(r"nccl-tests#\d+", spec.rates_source), name
        else:
            assert "no published achieved" in spec.rates_source or "round figures" in spec.rates_source, name
    for name in ("h100-80gb", "h100-96gb", "h200", "a100-80gb", "a100-40gb"):
        assert devices()[name].matmul_efficiency < 1, name


def test_a_measured_spec_is_achieved_already() -> None:
    spec = DeviceSpec.measure("cpu", size=64, repeats=1)
    assert spec.matmul_efficiency == 1 and spec.memory_efficiency == 1
    assert spec.matmul_flops(torch.float32) == spec.flops_fp32
    assert spec.achieved_memory_bytes_per_second == spec.memory_bytes_per_second
    assert spec.rates_source.startswith("measured")


def test_achieved_rates_are_checked() -> None:
    spec = devices()["l4"]
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        spec.replace(matmul_efficiency=1.5)
    with pytest.raises(ConfigError, match="fractions in"):
        spec.replace(bus_bytes_per_second=-1.0)
