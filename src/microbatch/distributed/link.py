"""The link between this launch's ranks, measured: point-to-point latency and bandwidth, and the
latency of a small collective. A pipeline sends an activation forward and a gradient back per
micro-batch and runs a few small collectives per window; on gloo over a CPU machine these cost
what no preset says, so the pipeline planner measures them on the ranks it plans for.

Ranks 0 and 1 exchange a small and a large tensor (a ping-pong: rank 0 sends, rank 1 sends back);
a round trip of n bytes takes 2 (latency + n / bandwidth), so two sizes give both. The fastest of a
few rounds is kept (a round slowed by another job's time slice says nothing about the link). Every
rank takes part and gets rank 0's numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .process import rank, world_size

SMALL_BYTES = 1 << 10
LARGE_BYTES = 1 << 21
ROUNDS = 5


@dataclass(frozen=True)
class LinkTimes:
    """One message's fixed cost, the bytes per second beyond it, one small collective's time."""

    latency_seconds: float
    bytes_per_second: float
    collective_seconds: float


def _round_trip_seconds(size: int, device: torch.device) -> float:
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(ROUNDS):
        dist.barrier()
        started = time.perf_counter()
        if rank() == 0:
            dist.send(buffer, dst=1)
            dist.recv(buffer, src=1)
        elif rank() == 1:
            dist.recv(buffer, src=0)
            dist.send(buffer, dst=0)
        best = min(best, time.perf_counter() - started)
    return best


def measure_link(device: torch.device | None = None) -> LinkTimes:
    """The link between ranks 0 and 1 and a small all-reduce over every rank (a collective)."""
    device = device or torch.device("cpu")
    if world_size() < 2:
        return LinkTimes(0.0, float("inf"), 0.0)
    small = _round_trip_seconds(SMALL_BYTES, device) / 2
    large = _round_trip_seconds(LARGE_BYTES, device) / 2
    per_byte = max(large - small, 1e-12) / (LARGE_BYTES - SMALL_BYTES)
    latency = max(0.0, small - SMALL_BYTES * per_byte)
    value = torch.zeros(1, dtype=torch.float64, device=device)
    collective = float("inf")
    for _ in range(ROUNDS):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(value)
        collective = min(collective, time.perf_counter() - started)
    numbers = torch.tensor([latency, 1.0 / per_byte, collective], dtype=torch.float64, device=device)
    dist.broadcast(numbers, src=0)
    return LinkTimes(float(numbers[0]), float(numbers[1]), float(numbers[2]))
