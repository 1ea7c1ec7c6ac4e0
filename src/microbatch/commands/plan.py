"""``microbatch plan MODEL --batch B --memory M``: choose micro-batch size, steps and checkpointing."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import ConfigError
from ..planner import plan
from ..planner.plot import save_frontier_plot
from ..workload import BUILTIN_WORKLOADS, load_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) or package.module:function returning one",
    )
    parser.add_argument(
        "--batch", type=int, required=True, help="effective batch per optimizer step, all ranks"
    )
    parser.add_argument(
        "--memory",
        required=True,
        help=(
            "peak memory budget per rank: a size with an optional unit ('8GiB', '300MiB', '1000000' bytes; "
            "whole bytes), or a fraction of the device's FREE memory at plan time: '80%%' or a decimal in "
            "(0, 1] such as 0.8. On CUDA: peak reserved bytes of the caching allocator + what is measured "
            "outside it (context, cuBLAS/cuDNN workspaces, NCCL); on CPU: peak live tensor bytes; with "
            "--world-size > 1 DDP's gradient buckets count too"
        ),
    )
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument(
        "--blocks",
        default="auto",
        help="comma-separated module names that may be checkpointed (default: auto, the repeated blocks)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies to consider (default: none,full,selective; offload on accelerators)",
    )
    parser.add_argument("--no-trial", action="store_true", help="trust the model: skip the real trial window")
    parser.add_argument(
        "--min-micro-batch",
        type=int,
        default=1,
        metavar="K",
        help="no micro-batch below K samples, the last included (e.g. 2 for BatchNorm after global pooling)",
    )
    parser.add_argument("--even", action="store_true", help="equal micro-batches: micro x steps == batch")
    parser.add_argument(
        "--prefer-large-micro-batches",
        action="store_true",
        help="the largest micro-batch that fits, then the fastest (BatchNorm normalises per micro-batch)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw the frontier (peak vs time per step) to PATH")
    parser.add_argument(
        "--out",
        metavar="PLAN.json",
        help="save the plan (Plan.load reads it; microbatch train --plan PLAN.json uses it)",
    )


class _Progress:
    """One line on stderr, rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.interactive = sys.stderr.isatty()
        self.last = ""
        self.quarter = -1

    def __call__(self, what: str, done: int, total: int) -> None:
        line = f"planning: {what} [{done}/{total}]" if total > 1 else f"planning: {what}"
        if self.interactive:
            print(f"\r{line:<78}", end="", file=sys.stderr, flush=True)
        elif total <= 1 or done * 4 // total != self.quarter:  # in a log: the start and each quarter
            self.quarter = done * 4 // total if total > 1 else -1
            print(line, file=sys.stderr)
        self.last = line

    def close(self) -> None:
        if self.interactive and self.last:
            print("\r" + " " * 78 + "\r", end="", file=sys.stderr, flush=True)


def _check_output(flag: str, path: str | None) -> None:
    """Refuse an output path that cannot be written before planning, not after (the plan would be lost)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK) or os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r}: cannot write there; choose a file in a folder you can write to")


def check_plot_path(path: str) -> None:
    """Refuse a --plot path that cannot be written, before planning (so no plan is lost)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib, or leave out --plot") from None
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise ConfigError(
            f"--plot {path} is a directory; give a file name such as {os.path.join(path, 'frontier.png')}"
        )
    extension = os.path.splitext(target)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension not in formats:
        raise ConfigError(
            f"--plot {path}: unknown image format {extension!r}; end it in {', '.join(sorted(formats))}"
        )
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path}: the directory {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise ConfigError(f"--plot {path} is not writable; choose a path you can write")


def run(args: argparse.Namespace) -> int:
    _check_output("--out", args.out)
    if args.plot:
        check_plot_path(args.plot)
    workload = load_workload(args.model)
    blocks = (
        "auto" if args.blocks == "auto" else [name.strip() for name in args.blocks.split(",") if name.strip()]
    )
    policies = None if args.policies is None else [p.strip() for p in args.policies.split(",") if p.strip()]
    progress = _Progress()
    try:
        result = plan(
            workload,
            batch=args.batch,
            memory=args.memory,
            world_size=args.world_size,
            blocks=blocks,
            policies=policies,
            trial=not args.no_trial,
            progress=progress,
            min_micro_batch_size=args.min_micro_batch,
            even=args.even,
            prefer_large_micro_batches=args.prefer_large_micro_batches,
        )
    finally:
        progress.close()
    if args.out:
        result.save(args.out)
    if args.plot:
        save_frontier_plot(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result)
        if args.plot:
            print(f"frontier plot: {args.plot}")
        if args.out:
            print(f"plan saved: {args.out}")
    return 0
