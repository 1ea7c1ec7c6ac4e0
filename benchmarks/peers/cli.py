"""``python benchmarks/peers [--quick] [--json] [--parts ...]``: run the parts, print the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import results

from .budget import run_budget
from .correctness import run_correctness
from .protocol import FULL, QUICK, quiet_peers
from .report import closing_notes, plots, render, versions
from .speed import run_speed

PARTS = ("correctness", "speed", "budget")


def build_report(*, quick: bool, parts: Sequence[str] = PARTS, threads: int = 1) -> dict[str, Any]:
    """Run the parts; ``quick`` uses small sizes and two rounds."""
    began = time.perf_counter()
    torch.set_num_threads(threads)  # one thread: the least noise on a shared machine
    quiet_peers()
    setup = QUICK if quick else FULL
    command = "python benchmarks/peers" + (" --quick" if quick else "")
    bench_command = "microbatch bench" + (" --quick" if quick else "") + " peers"
    if threads != 1:
        command += f" --threads {threads}"
    if tuple(parts) != PARTS:
        command += " --parts " + " ".join(parts)
    report: dict[str, Any] = {
        "suite": "peers",
        "title": "Peers",
        "command": command,
        "bench_command": bench_command,
        "quick": quick,
        "environment": results.environment(),
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
    }
    if "correctness" in parts:
        report["correctness"] = run_correctness()
    if "speed" in parts:
        report["speed"] = run_speed(setup)
    if "budget" in parts:
        report["budget"] = run_budget(setup)
    report["notes"] = closing_notes(report)
    report["seconds"] = time.perf_counter() - began
    report["markdown"] = render(report)
    report["plots"] = plots(report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="microbatch against Accelerate, Lightning and hand-written loops"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, two rounds: a smoke run (under a minute)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON (what microbatch bench reads)"
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the least noise)")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # what the peers print must not mix with the JSON
        report = build_report(quick=args.quick, parts=args.parts, threads=args.threads)
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if args.json else report["markdown"])
    return 0
