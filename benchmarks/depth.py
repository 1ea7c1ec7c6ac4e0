"""Selective at any depth: planning llama-3.1-8b and llama-3.1-70b with none / full / selective.

Each case runs the ``microbatch plan`` command end to end in a subprocess (wall and CPU seconds,
the plan it prints), then again in this process in parts: the simulation of the profile
(``simulate_config_profile``), and ``plan()`` on that profile, with the seconds spent in the
policy solver (planner/search/solve.py) and in pricing its points (Model.price) counted apart. Beside the
plan, the same planning restricted to none and full: the selective plan is the fastest that fits
when it is faster than every none / full plan that fits.

    python benchmarks/depth.py            # both cases, writes RESULTS.md
    python benchmarks/depth.py --quick    # the 8B case only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import results
from microbatch.hf.configs import ModelSetup, simulate_config_profile
from microbatch.memory import format_bytes
from microbatch.memory.device_specs import device_spec
from microbatch.planner import plan
from microbatch.planner.result.plans import Plan, summarize_policies
from microbatch.planner.search import pricing, solve

SECTION_TITLE = "Selective at any depth"
CASES = (
    ("llama-3.1-8b", 8, 256, 60),  # model, world size, batch, target seconds on this machine
    ("llama-3.1-70b", 64, 512, 120),
)
MEMORY = "79GiB"  # an H100 80GB reports 79.65 GiB; the preset refuses more


def command(model: str, world_size: int, batch: int) -> list[str]:
    return [
        "microbatch", "plan", model, "--device", "h100-80gb", "--world-size", str(world_size),
        "--shard", "fsdp", "--batch", str(batch), "--seq-len", "4096", "--precision", "bf16",
        "--memory", MEMORY,
    ]  # fmt: skip


def end_to_end(argv: list[str]) -> dict[str, Any]:
    """The command in a subprocess: wall seconds, CPU seconds (user + system), what it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "microbatch", *argv[1:], "--no-progress"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_seconds": wall, "cpu_seconds": cpu, "printed": done.stdout.rstrip()}


@contextlib.contextmanager
def counted(owner: Any, names: tuple[str, ...], totals: dict[str, float], key: str) -> Iterator[None]:
    """Add the CPU seconds spent in ``owner.<name>`` (outermost calls only) to ``totals[key]``."""
    originals = {name: getattr(owner, name) for name in names}
    depth = [0]

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            began = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    totals[key] = totals.get(key, 0.0) + time.process_time() - began

        return timed

    for name, function in originals.items():
        setattr(owner, name, wrap(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(owner, name, function)


def in_parts(model: str, world_size: int, batch: int) -> dict[str, Any]:
    """Simulation and planning timed apart (CPU seconds), and the none / full plan beside."""
    spec = device_spec("h100-80gb")
    setup = ModelSetup(seq_len=4096, precision="bf16")
    began = time.process_time()
    workload, profile = simulate_config_profile(
        model, setup, spec, max_micro_batch_size=min(batch // world_size, 16)
    )
    simulate_seconds = time.process_time() - began
    options: dict[str, Any] = {"world_size": world_size, "shard": "fsdp", "profile": profile, "device": spec}
    totals: dict[str, float] = {}
    began = time.process_time()
    with (
        counted(solve, ("solve", "frontier", "minimum_peak"), totals, "solver"),
        counted(pricing.Model, ("price",), totals, "pricing"),
    ):
        chosen = plan(workload, batch=batch, memory=MEMORY, **options)
    plan_seconds = time.process_time() - began
    narrow = plan(workload, batch=batch, memory=MEMORY, policies=["none", "full"], **options)
    return {
        "simulate_seconds": simulate_seconds,
        "plan_seconds": plan_seconds,
        "solver_seconds": totals.get("solver", 0.0),
        "pricing_seconds": totals.get("pricing", 0.0),
        "chosen": describe(chosen),
        "none_full": describe(narrow),
        "selective_faster": "selective" in dict(chosen.block_policies).values()
        and chosen.predicted_seconds_per_step < narrow.predicted_seconds_per_step,
    }


def describe(chosen: Plan) -> dict[str, Any]:
    return {
        "plan": f"{chosen.micro_batch_size} x {chosen.steps}, {summarize_policies(chosen.block_policies)}",
        "gradient_sync": chosen.gradient_sync,
        "peak": format_bytes(chosen.predicted_peak_bytes),
        "seconds_per_step": chosen.predicted_seconds_per_step,
    }


def section(report: dict[str, Any]) -> str:
    headers = [
        "command", "wall s", "CPU s", "target s", "simulate CPU s", "plan() CPU s", "of which solver",
        "of which pricing", "plan (sync)", "peak", "s/step", "none / full only (sync)", "its s/step",
    ]  # fmt: skip
    rows = []
    for case in report["cases"]:
        chosen, narrow = case["chosen"], case["none_full"]
        rows.append(
            [
                f"`{' '.join(case['command'])}`",
                f"{case['wall_seconds']:.1f}",
                f"{case['cpu_seconds']:.1f}",
                case["target_seconds"],
                f"{case['simulate_seconds']:.1f}",
                f"{case['plan_seconds']:.1f}",
                f"{case['solver_seconds']:.1f}",
                f"{case['pricing_seconds']:.1f}",
                f"{chosen['plan']} ({chosen['gradient_sync']})",
                chosen["peak"],
                f"{chosen['seconds_per_step']:.2f}",
                f"{narrow['plan']} ({narrow['gradient_sync']})",
                f"{narrow['seconds_per_step']:.2f}",
            ]
        )
    printed = []
    for case in report["cases"]:
        printed += ["", f"`{' '.join(case['command'])}` printed:", "", "```", case["printed"], "```"]
    return "\n".join(
        [
            "Named architectures search none, full and selective by default: the policy solver takes a run "
            "of identical decoder layers by the counts of each policy (planner/search/solve_runs.py), so 80 "
            "layers cost 3,321 count vectors, not a search over sequences. Wall and CPU seconds are the "
            "whole "
            "command in a subprocess (imports, simulation, planning, printing); the split beside it is a "
            "second run in this process, in CPU seconds: the simulated profile, then plan() on it, with "
            "the seconds inside the policy solver and inside pricing its points. The last two columns plan "
            "the same profile with policies none and full only: the chosen plan is the fastest that fits "
            "when it is faster than that one (the planner's tie rule may take a plan within 5 % of the "
            f"fastest that recomputes less). Load average at start: {report['load']}; the machine's 2 cores "
            "are shared with other jobs.",
            "",
            results.markdown_table(headers, rows),
            *printed,
            "",
            f"Reproduce: `{report['command']}`",
            "",
            results.environment_line(),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 8B case only")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    cases = []
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        for model, world_size, batch, target in CASES[:1] if args.quick else CASES:
            argv_of_case = command(model, world_size, batch)
            case: dict[str, Any] = {"command": argv_of_case, "target_seconds": target}
            case.update(end_to_end(argv_of_case))
            case.update(in_parts(model, world_size, batch))
            cases.append(case)
    report = {
        "cases": cases,
        "load": load,
        "command": results.reproducing_command(
            "depth", sys.argv[1:] if argv is None else list(argv), json_mode=args.json
        ),
    }
    return results.emit(SECTION_TITLE, section(report), report, json_mode=args.json, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
