"""Part 2, speed: seconds per optimizer step, side by side in interleaved rounds."""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .loops import Runner
from .protocol import (
    TOOLS,
    Setup,
    gpt2,
    hf_checkpoint_every_layer,
    mb_checkpoint_every_block,
    token_batches,
)


def speed_runners() -> dict[str, tuple[str, Runner]]:
    runners = {
        "nanogpt": ("hand-written nanoGPT-style loop (the baseline)", Runner("nanogpt")),
        **{tool: (TOOLS[tool], Runner(tool)) for tool in ("microbatch", "accelerate", "lightning")},
        "nanogpt+hf-checkpoint": (
            "nanoGPT-style loop + transformers gradient checkpointing (every layer)",
            Runner("nanogpt", hf_checkpoint_every_layer),
        ),
    }
    if importlib.util.find_spec("microbatch.checkpointing.api") is not None:
        runners["microbatch+checkpoint"] = (
            "microbatch `Accumulator` + `mb.checkpoint` (every block, full)",
            Runner("microbatch", mb_checkpoint_every_block),
        )
    return runners


def interleaved(
    runs: dict[str, Callable[[], dict[str, float]]], *, rounds: int, baseline: str
) -> dict[str, dict[str, float]]:
    """Every run once per round, in turn. Per key: median wall and CPU seconds per step, and the
    median over rounds of its CPU time over the baseline's in the same round (min and max too)."""
    seconds: dict[str, list[dict[str, float]]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            seconds[key].append(run())
    out = {}
    for key, values in seconds.items():
        ratios = {
            clock: [v[clock] / b[clock] for v, b in zip(values, seconds[baseline], strict=True)]
            for clock in ("wall", "cpu")
        }
        fastest = min(v["cpu_min"] for v in values)
        out[key] = {
            "seconds_per_step": statistics.median(v["wall"] for v in values),
            "cpu_seconds_per_step": statistics.median(v["cpu"] for v in values),
            "ratio": statistics.median(ratios["cpu"]),
            "ratio_min": min(ratios["cpu"]),
            "ratio_max": max(ratios["cpu"]),
            "wall_ratio": statistics.median(ratios["wall"]),
            # Load only ever adds time, so the fastest step of all rounds is the least disturbed one.
            "fastest_cpu_seconds": fastest,
            "fastest_ratio": fastest / min(v["cpu_min"] for v in seconds[baseline]),
        }
    return out


def run_speed(setup: Setup) -> dict[str, Any]:
    base = gpt2(setup)
    batches = token_batches(setup, setup.steps * (setup.timed_steps + 1), setup.micro_batch_size)
    runners = speed_runners()
    runs = {
        key: (lambda runner=runner: runner.seconds_per_step(base, batches, steps=setup.steps))
        for key, (_, runner) in runners.items()
    }
    timings = interleaved(runs, rounds=setup.rounds, baseline="nanogpt")  # type: ignore[arg-type]
    return {
        "setup": asdict(setup) | {"batch_size": setup.batch_size},
        "rows": [{"key": key, "label": label, **timings[key]} for key, (label, _) in runners.items()],
    }
