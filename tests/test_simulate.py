"""Simulated planning: device specs, fake-tensor memory against MemoryTracker, the roofline clock."""

from __future__ import annotations

import resource

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import microbatch as mb
from microbatch.checkpointing.api import find_blocks
from microbatch.errors import CheckpointError, ConfigError
from microbatch.memory.allocator import round_size, segment_size
from microbatch.memory.device_specs import DeviceSpec, device_spec, devices
from microbatch.planner.proof.trial_run import run_trial
from microbatch.planner.search.sizes import Candidate
from microbatch.profile.roofline import RooflineClock, all_gather_seconds, all_reduce_seconds
from microbatch.profile.simulate import simulate_window
from microbatch.workload import load_workload

CPU = devices()["cpu"].replace(context_bytes=0)
PRESETS = ("h100-80gb", "h200", "a100-80gb", "a100-40gb", "l4", "rtx4090", "rtx3090", "cpu")


def test_presets_have_published_figures() -> None:
    presets = devices()
    assert set(PRESETS) <= set(presets)
    for name in PRESETS:
        spec = presets[name]
        assert spec.memory_bytes > 0 and spec.memory_bytes_per_second > 0
        # Tensor cores: 16-bit at least as fast as TF32, TF32 at least as fast as plain float32.
        assert spec.flops(torch.bfloat16) >= spec.flops(torch.float32, tf32=True) >= spec.flops(torch.float32)
    assert presets["h100-80gb"].memory_bytes == 81559 * 1024**2  # nvidia-smi: 81559MiB
    assert presets["h200"].memory_bytes_per_second > presets["h100-80gb"].memory_bytes_per_second


def test_user_defined_spec_and_errors() -> None:
    mine = devices()["l4"].replace(name="my-l4", memory_bytes=20 * 1024**3)
    assert device_spec(mine) is mine
    with pytest.raises(ConfigError, match="flops_bf16"):
        devices()["l4"].replace(flops_bf16=0)
    with pytest.raises(ConfigError, match="h100-80gb"):
        device_spec("h100")


def test_measure_on_cpu() -> None:
    spec = DeviceSpec.measure("cpu", size=64, repeats=1)
    assert spec.kind == "cpu" and spec.context_bytes == 0
    assert min(spec.flops_fp32, spec.flops_bf16, spec.memory_bytes_per_second) > 0
    assert spec.memory_bytes > 0


def test_roofline_of_a_matmul_is_its_flops_over_the_peak() -> None:
    spec = devices()["a100-80gb"]
    m, k, n = 512, 1024, 256
    with FakeTensorMode():
        a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
        with RooflineClock(spec) as clock:
            a @ b
    flops = 2 * m * k * n
    moved = 2 * (m * k + k * n + m * n)
    assert clock.flops == flops
    achieved = spec.flops_bf16 * spec.matmul_efficiency  # the achieved matmul rate (issue 20)
    expected = max(flops / achieved, moved / spec.achieved_memory_bytes_per_second) + spec.launch_seconds
    assert clock.seconds == pytest.approx(expected)
    with FakeTensorMode():
        a, grads = torch.empty(8, 8), [torch.empty(1000) for _ in range(3)]
        with RooflineClock(spec) as clock:
            a.device, a.shape[0], a.t()  # metadata and a view: no time
            torch._foreach_mul_(grads, 2.0)  # in place, returns nothing: one launch, 24 kB moved
    assert clock.ops == 1
    assert clock.seconds == pytest.approx(
        24_000 / spec.achieved_memory_bytes_per_second + spec.launch_seconds
    )


def test_collectives_and_allocator_rounding() -> None:
    spec = devices()["h100-80gb"]
    n = 8 * 10**9
    assert all_reduce_seconds(n, 1, spec) == 0
    assert all_reduce_seconds(n, 8, spec) == pytest.approx(2 * 7 / 8 * n / spec.bus_bytes_per_second)
    assert all_gather_seconds(n, 8, spec) == pytest.approx(all_reduce_seconds(n, 8, spec) / 2)
    assert round_size(1) == 512 and round_size(1024**2 + 1) == 1024**2 + 512
    assert segment_size(11 * 1024**2) == 12 * 1024**2


def _policies(workload: mb.Workload) -> list[dict[str, str]]:
    try:
        names = [name for name, _ in find_blocks(workload.model)]
    except CheckpointError:
        return [{}]
    return [dict.fromkeys(names, policy) for policy in ("none", "full", "selective")]


WORKLOADS = [
    "seed-linear",
    "lm-varlen",
    "cnn-bn",
    "gpt-mini",
    "microbatch.hf:tiny_gpt2_workload",
    "microbatch.hf:tiny_llama_workload",
]


@pytest.mark.parametrize("name", WORKLOADS)
def test_simulated_peak_within_3_percent_of_measured(name: str) -> None:
    if name.startswith("microbatch.hf"):
        pytest.importorskip("transformers")
    workload = load_workload(name)
    before = [p.detach().clone() for p in workload.model.parameters()]
    for policies in _policies(workload):
        sizes = (2, 2)  # a window's first two micro-batches: the trial's, every gradient live in the second
        real = run_trial(workload, Candidate(sizes, tuple(policies.items()), 0, 0.0)).peak_bytes
        tracker = simulate_window(workload, CPU, micro_batch_sizes=sizes, policies=policies)
        assert tracker.peak_bytes == pytest.approx(real, rel=0.03), (policies, tracker.peak_bytes, real)
    # The simulation left the real parameters as they were.
    for parameter, copy in zip(workload.model.parameters(), before, strict=True):
        assert not isinstance(parameter, torch._subclasses.fake_tensor.FakeTensor)
        torch.testing.assert_close(parameter.detach(), copy, rtol=0, atol=0)


def test_simulating_a_large_model_allocates_little() -> None:
    pytest.importorskip("transformers")
    from microbatch.hf.configs import ModelSetup, simulate_config_profile

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    setup = ModelSetup(seq_len=256, precision="fp32")
    workload, profile = simulate_config_profile(
        "llama-3.2-1b", setup, devices()["a100-80gb"], max_micro_batch_size=2, policies=["none"]
    )
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    # Real fp32 weights, gradients and Adam state of 1.2 B parameters: about 20 GB.
    assert profile.static_bytes > 15 * 1024**3
    assert len(profile.blocks) == 16
    assert rss_growth < 512 * 1024**2, rss_growth
    assert all(p.device.type == "meta" for p in workload.model.parameters())


def test_plan_on_a_preset_is_simulated_and_covers_the_batch() -> None:
    workload = load_workload("gpt-mini")
    plan = mb.plan(workload, batch=24, memory="600MiB", device="a100-80gb")
    assert plan.simulated and plan.trials == 0 and plan.measured_peak_bytes is None
    assert plan.device_name == "a100-80gb"
    assert sum(plan.micro_batch_sizes) == 24
    assert plan.predicted_peak_bytes <= 600 * 1024**2
    assert sum(value for _, value in plan.peak_parts) == plan.predicted_peak_bytes
    assert any("simulated" in note for note in plan.notes)
    assert dict(plan.rank_parts)["CUDA context and workspaces (allowance)"] == 512 * 1024**2
    assert "accelerate estimate-memory: training using Adam" in dict(plan.estimates)
    again = mb.Plan.from_dict(plan.to_dict())  # a saved simulated plan reads back whole
    assert (again.simulated, again.rank_parts, again.estimates) == (True, plan.rank_parts, plan.estimates)


def test_simulate_on_the_present_device_and_a_torch_device_for_real() -> None:
    workload = load_workload("seed-linear")
    simulated = mb.plan(workload, batch=8, memory="64MiB", device="cpu", simulate=True)
    assert simulated.simulated and simulated.device_name == "cpu" and simulated.trials == 0
    real = mb.plan(workload, batch=8, memory="64MiB", device=torch.device("cpu"))
    assert not real.simulated and real.trials >= 1 and real.measured_peak_bytes is not None
    # The same model planned both ways: the same peak, bar the simulated plan's margin.
    assert simulated.predicted_peak_bytes == pytest.approx(real.predicted_peak_bytes, rel=0.03)
    with pytest.raises(ConfigError, match="preset"):
        mb.plan(workload, batch=8, memory="64MiB", device="tpu-v9")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="h100-80gb"):
            mb.plan(workload, batch=8, memory="64MiB", device="cuda:0")
