"""Devices described by numbers: memory, peak FLOP/s per dtype, bandwidth, launch floor, interconnect.

A ``DeviceSpec`` is what the simulated planner needs to know about a device that may not be here
(``mb.plan(..., device="h100-80gb")``). The presets hold published figures: dense (no 2:4
sparsity) tensor-core peaks for 16-bit and TF32, the CUDA-core peak for FP32, the memory
bandwidth, and per-GPU one-direction interconnect bandwidth (NVLink for SXM parts, PCIe 4.0 x16
for PCIe cards). No real kernel reaches a peak, so each preset also holds the rates that public
measurements show kernels achieve, per op class (issue 20): large matmuls (a fraction of the peak),
fused attention (FlashAttention's FLOP/s), memory-bound kernels (a fraction of the bandwidth) and
collectives (NCCL's measured bus bandwidth within and across nodes), each cited in
``rates_source``; the roofline (profile/roofline.py) prices every op with them.
``DeviceSpec.measure()`` fills a spec from a short matmul and copy benchmark on a device that is
present: its figures are achieved already (efficiency 1).

Memory is what the card reports as its total (``nvidia-smi``'s memory.total, which is
``torch.cuda.get_device_properties().total_memory``), not the marketing size: an "80 GB" H100
reports 81,559 MiB (79.6 GiB), so an 80 GiB budget is refused on the preset as on the card. Each
preset's ``source`` names where its figure comes from. The driver and the CUDA context take some
of it, which the planner counts as ``context_bytes`` on CUDA targets: the
allowance for what the caching allocator does not see (a round 512 MiB for presets, measured by
``DeviceSpec.measure()``). What the allocator does hold is predicted by replaying the simulated
allocations through ``microbatch.memory.allocator`` (see profile/reserved.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .allocator import outside_allocator_bytes
from .budget import device_memory_bytes
from .units import format_bytes

GIB = 1024**3
MIB = 1024**2
TERA = 1e12
GIGA = 1e9
# What a CUDA process holds outside the caching allocator (measured on recent drivers with lazy
# module loading: the context 300-500 MiB, cuBLAS / cuDNN workspaces tens of MiB): a round 512 MiB.
CUDA_CONTEXT_BYTES = 512 * 1024**2
# A CUDA kernel launch and its completion cost a few microseconds whatever the kernel does.
CUDA_LAUNCH_SECONDS = 5e-6

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


@dataclass(frozen=True)
class DeviceSpec:
    """A device for the simulated planner (all rates per second, per device).

    ``flops_tf32`` is the rate of float32 matmuls when TF32 is allowed
    (``torch.backends.cuda.matmul.allow_tf32``); without it float32 matmuls run at ``flops_fp32``.
    ``interconnect_bytes_per_second`` is one direction of one device's link to its peers (the
    bandwidth a ring all-reduce or reduce-scatter is bound by).
    """

    name: str
    kind: str  # "cuda" or "cpu": which allocator model and allowances apply
    memory_bytes: int
    flops_fp32: float
    flops_tf32: float
    flops_bf16: float
    flops_fp16: float
    memory_bytes_per_second: float
    launch_seconds: float = CUDA_LAUNCH_SECONDS
    interconnect_bytes_per_second: float = 32 * GIGA
    interconnect: str = "PCIe 4.0 x16"
    context_bytes: int = CUDA_CONTEXT_BYTES
    source: str = "published figures"
    # Achieved rates (what real kernels reach; the fields above are peaks). Defaults: the peaks.
    matmul_efficiency: float = 1.0  # large 16-bit / TF32 / fp32 matmuls: achieved / peak
    attention_flops_per_second: float = 0.0  # fused 16-bit attention (FlashAttention); 0: matmul's
    memory_efficiency: float = 1.0  # memory-bound kernels: achieved / peak bandwidth
    bus_bytes_per_second: float = 0.0  # NCCL ring bus bandwidth within a node; 0: the link's
    network_bus_bytes_per_second: float = 0.0  # the same across nodes; 0: as within a node
    gpus_per_node: int = 8
    rates_source: str = "peak figures (no achieved rates stated)"

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ConfigError(f"DeviceSpec kind must be 'cuda' or 'cpu', got {self.kind!r}")
        numbers = {
            "memory_bytes": self.memory_bytes,
            "flops_fp32": self.flops_fp32,
            "flops_tf32": self.flops_tf32,
            "flops_bf16": self.flops_bf16,
            "flops_fp16": self.flops_fp16,
            "memory_bytes_per_second": self.memory_bytes_per_second,
            "interconnect_bytes_per_second": self.interconnect_bytes_per_second,
        }
        bad = [name for name, value in numbers.items() if not value > 0]
        if bad or self.launch_seconds < 0 or self.context_bytes < 0:
            raise ConfigError(
                f"DeviceSpec {self.name!r}: {', '.join(bad) or 'launch_seconds / context_bytes'} must be "
                "positive (launch_seconds and context_bytes may be 0)"
            )
        fractions = {"matmul_efficiency": self.matmul_efficiency, "memory_efficiency": self.memory_efficiency}
        wrong = [name for name, value in fractions.items() if not 0 < value <= 1]
        rates = (
            self.attention_flops_per_second,
            self.bus_bytes_per_second,
            self.network_bus_bytes_per_second,
        )
        if wrong or min(rates) < 0 or self.gpus_per_node < 1:
            raise ConfigError(
                f"DeviceSpec {self.name!r}: {', '.join(wrong) or 'achieved rates / gpus_per_node'}: "
                "efficiencies are fractions in (0, 1], achieved rates >= 0 (0: derived from the peaks), "
                "gpus_per_node >= 1"
            )

    def flops(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Peak FLOP/s of a matmul in ``dtype`` (float64 and integers at the fp32 rate)."""
        name = _DTYPES.get(dtype, "fp32")
        if name == "fp32" and tf32:
            return self.flops_tf32
        return {"fp16": self.flops_fp16, "bf16": self.flops_bf16}.get(name, self.flops_fp32)

    def matmul_flops(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Achieved FLOP/s of a large matmul in ``dtype``: the peak times ``matmul_efficiency``."""
        return self.flops(dtype, tf32=tf32) * self.matmul_efficiency

    def attention_flops(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Achieved FLOP/s of a fused attention kernel (causal FLOPs counted half, as FlashAttention's).

        16-bit attention runs FlashAttention's kernels (``attention_flops_per_second``); other dtypes,
        or a spec without the figure, at the matmul's achieved rate.
        """
        if self.attention_flops_per_second and dtype in (torch.float16, torch.bfloat16):
            return self.attention_flops_per_second
        return self.matmul_flops(dtype, tf32=tf32)

    @property
    def achieved_memory_bytes_per_second(self) -> float:
        """What memory-bound kernels move per second: the peak bandwidth times ``memory_efficiency``."""
        return self.memory_bytes_per_second * self.memory_efficiency

    def collective_bytes_per_second(self, world_size: int) -> float:
        """The ring bus bandwidth of a collective over ``world_size`` ranks.

        NCCL's bus bandwidth (nccl-tests' busbw) is the rate at which each rank's link carries the
        ring's traffic, so a ring all-gather of n bytes takes (W - 1) / W * n / busbw. Within a node
        it is ``bus_bytes_per_second``; a ring across nodes runs no faster than the network's
        (``network_bus_bytes_per_second``). Without them: the link's one-direction line rate.
        """
        bus = self.bus_bytes_per_second or self.interconnect_bytes_per_second
        if world_size > self.gpus_per_node and self.network_bus_bytes_per_second:
            return min(bus, self.network_bus_bytes_per_second)
        return bus

    @property
    def rates_summary(self) -> str:
        """The achieved rates in one line: 'matmul 80 % of peak, attention 335 TFLOP/s, ...'."""
        attention = (
            f"{self.attention_flops_per_second / TERA:.0f} TFLOP/s"
            if self.attention_flops_per_second
            else "at the matmul rate"
        )
        return (
            f"matmul {self.matmul_efficiency:.0%} of peak, attention {attention}, memory-bound "
            f"{self.achieved_memory_bytes_per_second / GIGA:,.0f} GB/s, collectives "
            f"{self.collective_bytes_per_second(1) / GIGA:.0f} GB/s bus bandwidth"
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind)

    def replace(self, **changes: Any) -> DeviceSpec:
        """A copy with some fields changed: ``mb.devices()["l4"].replace(memory_bytes=...)``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.name}: {format_bytes(self.memory_bytes)}, bf16 {self.flops_bf16 / TERA:.0f} TFLOP/s, "
            f"fp32 {self.flops_fp32 / TERA:.1f} TFLOP/s, {self.memory_bytes_per_second / 1e9:.0f} GB/s, "
            f"{self.interconnect} {self.interconnect_bytes_per_second / 1e9:.0f} GB/s ({self.source})"
        )

    @classmethod
    def measure(
        cls,
        device: torch.device | str = "cpu",
        *,
        name: str | None = None,
        size: int = 1024,
        repeats: int = 3,
    ) -> DeviceSpec:
        """A spec of a present device from a short benchmark: matmuls per dtype and a large copy.

        ``size``: the matmul side (n x n x n, 2 n^3 FLOPs); the copy moves 64 n^2 bytes. Each is
        the best of ``repeats`` timed runs after a warm-up. Launch floor: the best time of a tiny op.
        """
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ConfigError(f"DeviceSpec.measure: device must be cpu or cuda, got {device}")
        rates = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.randn(size, size, device=device, dtype=dtype)
            seconds = _best_seconds(lambda a=a: torch.mm(a, a), device, repeats)
            rates[dtype] = 2 * size**3 / seconds
        source = torch.empty(16 * size * size, device=device, dtype=torch.float32)
        target = torch.empty_like(source)
        copy_seconds = _best_seconds(lambda: target.copy_(source), device, repeats)
        tiny = torch.ones(1, device=device)
        launch = _best_seconds(lambda: tiny.add_(0), device, repeats)
        tf32 = rates[torch.float32]
        if device.type == "cuda":
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                a = torch.randn(size, size, device=device)
                tf32 = 2 * size**3 / _best_seconds(lambda: torch.mm(a, a), device, repeats)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
        return cls(
            name=name or (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (measured)"),
            kind=device.type,
            memory_bytes=device_memory_bytes(device),
            flops_fp32=rates[torch.float32],
            flops_tf32=tf32,
            flops_bf16=rates[torch.bfloat16],
            flops_fp16=rates[torch.float16],
            # The copy reads and writes every byte once.
            memory_bytes_per_second=2 * source.numel() * source.element_size() / copy_seconds,
            launch_seconds=launch,
            # On a present GPU the allowance outside the caching allocator is measured, not assumed.
            context_bytes=outside_allocator_bytes(device) if device.type == "cuda" else 0,
            source=f"measured: {size}^3 matmuls, {format_bytes(source.numel() * 4)} copy",
            rates_source="measured: the figures are achieved rates (efficiency 1)",
        )


def _best_seconds(work: Any, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``work`` after one untimed call."""
    work()
    timings = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - began)
    return max(min(timings), 1e-9)


@dataclass(frozen=True)
class _Achieved:
    """A preset's achieved rates (DeviceSpec's fields of the same names) and where they come from."""

    matmul_efficiency: float = 1.0
    attention_flops_per_second: float = 0.0
    memory_efficiency: float = 1.0
    bus_bytes_per_second: float = 0.0
    network_bus_bytes_per_second: float = 0.0
    source: str = "no published achieved rates found: the peaks (an optimistic time)"


def _gpu(
    name: str,
    memory_mib: int,
    fp32: float,
    tf32: float,
    bf16: float,
    bandwidth_gbs: float,
    link: str,
    link_gbs: float,
    memory_source: str,
    achieved: _Achieved | None = None,
    *,
    fp16: float | None = None,
) -> DeviceSpec:
    rates = achieved or _Achieved()
    return DeviceSpec(
        name=name,
        kind="cuda",
        memory_bytes=memory_mib * MIB,
        flops_fp32=fp32 * TERA,
        flops_tf32=tf32 * TERA,
        flops_bf16=bf16 * TERA,
        flops_fp16=(bf16 if fp16 is None else fp16) * TERA,
        memory_bytes_per_second=bandwidth_gbs * GIGA,
        interconnect=link,
        interconnect_bytes_per_second=link_gbs * GIGA,
        source=f"published figures; memory {memory_mib:,} MiB as nvidia-smi reports it ({memory_source})",
        matmul_efficiency=rates.matmul_efficiency,
        attention_flops_per_second=rates.attention_flops_per_second,
        memory_efficiency=rates.memory_efficiency,
        bus_bytes_per_second=rates.bus_bytes_per_second,
        network_bus_bytes_per_second=rates.network_bus_bytes_per_second,
        rates_source=rates.source,
    )


# Dense peaks from NVIDIA's data sheets (H100 SXM5, H100 NVL, H200 SXM, A100 SXM4, V100 SXM2, L4, and
# the Ada / Ampere GeForce white papers: 16-bit tensor rates with FP32 accumulation, as PyTorch uses
# them). Interconnect: NVLink 4 (H100 / H200) 900 GB/s, NVLink 3 (A100) 600 GB/s and NVLink 2
# (V100 SXM2, 6 links) 300 GB/s, both directions together, so 450, 300 and 150 per direction;
# PCIe 4.0 x16 32 GB/s per direction.
# Memory: nvidia-smi's memory.total of each card (MiB), from public reports:
_H100_SMI = "nvidia-smi in NVIDIA/nccl#1264 and modal-labs/modal-client#2797: 81559MiB"
_H100_96_SMI = (
    "nvidia-smi of 96 GB Hopper parts (GH200 96GB, H20) in public logs, taken for the H100 96GB: 97871MiB"
)
_H200_SMI = "nvidia-smi of H200 SXM nodes, driver 570.158.01, in public logs: 143771MiB"
_A100_80_SMI = "modal-labs/modal-client#2797: 81920MiB; A800-SXM4-80GB the same in dexmal/dexbotic#41"
_A100_40_SMI = "modal-labs/modal-client#2797: 40960MiB"
_V100_SMI = "nvidia-smi of Tesla V100-SXM2-16GB in public logs: 16160MiB"
_L4_SMI = "modal-labs/modal-client#2797: 23034MiB"
_RTX4090_SMI = "nvidia-smi in RLinf/RLinf#255: 24564MiB"
_RTX3090_SMI = "nvidia-smi in noonghunna/club-3090#390: 24576MiB"

# Achieved rates per op class (issue 20), from public measurements, none fitted to a training run:
# - matmul: the Maximum Achievable Matmul FLOPS (MAMF, best-shape bf16 matmul) of ml-engineering's
#   table (github.com/stas00/ml-engineering, compute/accelerator/README.md#maximum-achievable-matmul-
#   flops-comparison-table): A100 SXM 267.9 of 312 TFLOP/s (85.9 %), H100 SXM 792.1 of 989 (80.1 %).
# - attention: FlashAttention-2 (Dao 2023, arXiv:2307.08691; PyTorch's SDPA flash kernel): forward +
#   backward at 50-73 % of the A100's peak (the abstract), taken at the middle, 61.5 %: 192 TFLOP/s;
#   on H100 the same kernels reach up to 335 TFLOP/s (the paper's H100 benchmark). Causal FLOPs
#   counted half, as the paper counts them.
# - memory-bound kernels: coalesced HBM3 loads at 2.8 of 3.35 TB/s (84 %) measured with Nsight
#   Compute on H100 SXM5 (mikamirai.com/blog/gpu-memory-bandwidth); no such figure was found for the
#   A100's HBM2e, which takes the same fraction.
# - collectives, NCCL ring bus bandwidth (nccl-tests' busbw): NVLink 4 ~370 GB/s of its 450 line
#   rate, NVLink 3 ~230 GB/s of 300 (sjeaugey, NCCL's maintainer, in NVIDIA/nccl-tests#212 and #149).
#   Across nodes: a DGX A100 (8 x 200 Gb/s InfiniBand) measures 192 GB/s all-reduce busbw
#   (AddyLaddy, NVIDIA, in NVIDIA/nccl#812); 8 x 400 Gb/s per H100 node is twice that, 384 GB/s,
#   so NVLink's 370 bounds the ring.
_MAMF = "MAMF in stas00/ml-engineering compute/accelerator/README.md"
_FA2 = "FlashAttention-2 (arXiv:2307.08691)"
_HBM = "84 % HBM (coalesced loads on H100 SXM5, mikamirai.com/blog/gpu-memory-bandwidth)"
_H100_RATES = _Achieved(
    matmul_efficiency=792.1 / 989,
    attention_flops_per_second=335 * TERA,
    memory_efficiency=0.84,
    bus_bytes_per_second=370 * GIGA,
    network_bus_bytes_per_second=384 * GIGA,
    source=(
        f"matmul 80.1 % ({_MAMF}: H100 SXM 792.1 of 989 TFLOP/s); attention 335 TFLOP/s ({_FA2} on "
        f"H100); {_HBM}; NCCL busbw 370 GB/s on NVLink 4 (NVIDIA/nccl-tests#212), 384 GB/s across "
        "nodes of 8 x 400 Gb/s (twice DGX A100's 192, NVIDIA/nccl#812)"
    ),
)
_A100_RATES = _Achieved(
    matmul_efficiency=267.9 / 312,
    attention_flops_per_second=0.615 * 312 * TERA,
    memory_efficiency=0.84,
    bus_bytes_per_second=230 * GIGA,
    network_bus_bytes_per_second=192 * GIGA,
    source=(
        f"matmul 85.9 % ({_MAMF}: A100 SXM 267.9 of 312 TFLOP/s); attention 61.5 % of peak, 192 "
        f"TFLOP/s (the middle of {_FA2}'s 50-73 % on A100); {_HBM}, the H100's fraction; NCCL busbw "
        "230 GB/s on NVLink 3 (NVIDIA/nccl-tests#149), 192 GB/s across DGX A100 nodes (NVIDIA/nccl#812)"
    ),
)
_V100_RATES = _Achieved(
    matmul_efficiency=83 / 125,
    memory_efficiency=0.84,
    source=(
        "matmul 66.4 % (cuBLAS fp16 GEMM on tensor cores: up to 83 of 125 TFLOP/s on a Tesla V100, "
        "Markidis et al., arXiv:1803.04014); attention at the matmul rate (no FlashAttention kernel "
        f"for sm70: SDPA's memory-efficient one); {_HBM}, the H100's fraction; no NCCL figure found: "
        "NVLink 2's line rate"
    ),
)
_PRESETS = (
    _gpu("h100-80gb", 81559, 66.9, 494.7, 989.4, 3350, "NVLink 4", 450, _H100_SMI, _H100_RATES),
    # The H100 96GB HBM2e of torchtitan's benchmarks (docs/performance.md: 2.4 TB/s, 500 W power
    # limit; "the actual peak TFLOPs number is between SXM and NVL"): the H100 NVL's dense peaks
    # (1,671 TFLOP/s bf16 with sparsity: 835.5 dense; TF32 417.5; FP32 60), the lower bound.
    _gpu("h100-96gb", 97871, 60, 417.5, 835.5, 2400, "NVLink 4", 450, _H100_96_SMI, _H100_RATES),
    _gpu("h200", 143771, 66.9, 494.7, 989.4, 4800, "NVLink 4", 450, _H200_SMI, _H100_RATES),
    _gpu("a100-80gb", 81920, 19.5, 156, 312, 2039, "NVLink 3", 300, _A100_80_SMI, _A100_RATES),
    _gpu("a100-40gb", 40960, 19.5, 156, 312, 1555, "NVLink 3", 300, _A100_40_SMI, _A100_RATES),
    # V100 SXM2: 125 TFLOP/s fp16 tensor cores, 15.7 fp32; no TF32 and no bfloat16 tensor cores
    # (bfloat16 matmuls run at the fp32 rate); 900 GB/s HBM2.
    _gpu("v100-16gb", 16160, 15.7, 15.7, 15.7, 900, "NVLink 2", 150, _V100_SMI, _V100_RATES, fp16=125),
    _gpu("l4", 23034, 30.3, 60, 121, 300, "PCIe 4.0 x16", 32, _L4_SMI),
    _gpu("rtx4090", 24564, 82.6, 82.6, 165.2, 1008, "PCIe 4.0 x16", 32, _RTX4090_SMI),
    _gpu("rtx3090", 24576, 35.6, 35.6, 71, 936, "PCIe 4.0 x16", 32, _RTX3090_SMI),
)


def check_preset_budget(budget_bytes: int, spec: DeviceSpec, *, name: str = "memory") -> None:
    """Refuse a budget above ``spec``'s total memory, as a present device's is refused."""
    if budget_bytes > spec.memory_bytes:
        raise ConfigError(
            f"{name}={format_bytes(budget_bytes)} is above {spec.name}'s total memory "
            f"{format_bytes(spec.memory_bytes)} ({spec.memory_bytes // MIB:,} MiB, what the card reports); "
            f"give at most {format_bytes(spec.memory_bytes)}, or a fraction such as 0.9 of it"
        )


def _cpu_preset() -> DeviceSpec:
    """A generic host: the machine's RAM, and modest round figures (``measure()`` does better)."""
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        memory_bytes=device_memory_bytes("cpu"),
        flops_fp32=1 * TERA,
        flops_tf32=1 * TERA,
        flops_bf16=1 * TERA,
        flops_fp16=0.5 * TERA,
        memory_bytes_per_second=50 * GIGA,
        launch_seconds=2e-6,
        interconnect="Ethernet (gloo)",
        interconnect_bytes_per_second=1.25 * GIGA,
        context_bytes=0,
        source="round figures for a many-core server CPU",
        rates_source="round figures, taken as achieved (DeviceSpec.measure('cpu') measures them)",
    )


def devices() -> dict[str, DeviceSpec]:
    """The presets by name: h100-80gb, h100-96gb, h200, a100-80gb, a100-40gb, v100-16gb, l4, rtx4090,
    rtx3090, cpu."""
    return {**{spec.name: spec for spec in _PRESETS}, "cpu": _cpu_preset()}


def device_spec(device: DeviceSpec | str) -> DeviceSpec:
    """A DeviceSpec from itself or a preset name; a ConfigError naming the presets otherwise."""
    if isinstance(device, DeviceSpec):
        return device
    presets = devices()
    key = str(device).strip().lower()
    if key not in presets:
        raise ConfigError(
            f"device={device!r} is not a device preset; choose one of {', '.join(presets)}, pass a "
            "torch device such as 'cuda:0', or a mb.DeviceSpec(...)"
        )
    return presets[key]
