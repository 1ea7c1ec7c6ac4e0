"""``microbatch plan MODEL --batch B --memory M``: choose micro-batch size, steps and checkpointing."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import ConfigError, UsageError
from ..hf.configs import (
    OPTIMIZERS,
    PRECISIONS,
    ModelSetup,
    is_architecture,
    simulate_config_profile,
)
from ..memory.device_specs import device_spec, devices
from ..planner import plan
from ..planner.options import SHARDS
from ..planner.result.applying import GRADIENT_SYNCS
from ..planner.result.plot import save_frontier_plot
from ..planner.target.simulated import target_budget
from ..profile import stash
from .models import load_named_workload, model_help
from .output import dumps
from .progress import PlanningBar

EXIT_STATUS = (
    "Exit status: 0 a plan was found (printed, or saved with --out); 2 a usage mistake, a budget no "
    "plan fits (the message names the least that would) or an error raised by your own code "
    "(-v/--verbose shows its traceback); 3 an internal error of microbatch; 130 interrupted."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=model_help(architectures=True))
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
    parser.add_argument(
        "--world-size", type=int, default=1, help="ranks (default 1); with --pipeline S: W / S replicas of S"
    )
    _add_pipeline_arguments(parser)
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
        "--no-race",
        action="store_true",
        help="keep the prediction's choice among plans it cannot tell apart, untimed (faster planning)",
    )
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
    _add_device_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr while planning")
    parser.add_argument("--plot", metavar="PATH", help="draw the frontier (peak vs time per step) to PATH")
    parser.add_argument(
        "--out",
        metavar="PLAN.json",
        help="save the plan (Plan.load reads it; microbatch train --plan PLAN.json uses it)",
    )


def _add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline",
        type=int,
        default=1,
        metavar="S",
        help="cut the model into S pipeline stages (schedule, micro-batches per step and cuts planned)",
    )
    parser.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "gpipe"),
        default=None,
        help="--pipeline: this schedule only (default: the planner compares both)",
    )


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for planning on a device that is not here, and for named architectures."""
    parser.add_argument(
        "--device",
        default=None,
        help=f"a torch device to profile on (cpu, cuda:0), or a preset to simulate ({', '.join(devices())})",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="predict under fake tensors on a present device: no kernel runs",
    )
    parser.add_argument(
        "--shard", choices=SHARDS, default="none", help="data parallelism across --world-size"
    )
    parser.add_argument(
        "--gradient-sync",
        choices=GRADIENT_SYNCS,
        default=None,
        help="--shard fsdp: reduce-scatter once per window or every micro-batch (default: planner chooses)",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip gradients to this total norm once per window (the plan is made, and applied, with it)",
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (architectures)")
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="bf16",
        help=(
            "architectures: bf16 / fp16 / fp32 parameters, gradients and optimizer state in that dtype; "
            "mixed: fp32 parameters, gradients and optimizer state, forward and backward under bf16 "
            "autocast (HF AMP), or with --shard fsdp FSDP2's MixedPrecisionPolicy(bf16, fp32) (torchtitan); "
            "mixed-fp16: the same in fp16 (AMP without bf16, e.g. V100)"
        ),
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (architectures)")
    parser.add_argument(
        "--moe-capacity-factor",
        type=float,
        default=1.0,
        help=(
            "architectures, mixtures of experts: the routing simulated for transformers' eager expert loop, "
            "the busiest expert this many times its balanced top_k/E share of the tokens (1: balanced); "
            "grouped-GEMM experts (transformers' default) are sized by the routed rows whatever the routing"
        ),
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (needs peft)"
    )


def _architecture(
    args: argparse.Namespace,
    policies: list[str] | None,
    progress: PlanningBar | None,
    *,
    head_chunk_tokens: int | None = None,
) -> Any:
    """The full model's workload and its simulated profile, for a named architecture or config.json."""
    if args.device is None:
        raise UsageError(
            f"{args.model} is an architecture with fake weights: pass --device ({', '.join(devices())})"
        )
    setup = ModelSetup(
        seq_len=args.seq_len, precision=args.precision, optimizer=args.optimizer, lora_rank=args.lora_rank
    )
    spec = device_spec(args.device)
    target_budget(args.memory, spec, None)  # a budget the preset cannot hold: refused before simulating
    per_rank = max(1, args.batch // max(1, args.world_size // max(1, args.pipeline)))
    # policies=None: none, full and selective (the simulated profiler's default). The solver takes
    # the identical layers by counts of each policy (planner/search/solve_runs.py), so depth costs little.
    # The runs are of a three-layer copy, not the plan's memory: their allocator replays are
    # estimates (profile/reserved.py), with no capacity set.
    return simulate_config_profile(
        args.model,
        setup,
        spec,
        max_micro_batch_size=min(per_rank, 16),
        policies=policies,
        progress=progress,
        shard=args.shard,
        head_chunk_tokens=head_chunk_tokens,
        moe_capacity_factor=args.moe_capacity_factor,
    )


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


def _names(listed: str) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [name.strip() for name in listed.split(",") if name.strip()]


def run(args: argparse.Namespace) -> int:
    _check_output("--out", args.out)
    stash.remove_stale_stashes()  # planner stash files of processes killed outright (kill -9)
    if args.plot:
        check_plot_path(args.plot)
    blocks = "auto" if args.blocks == "auto" else _names(args.blocks)
    policies = None if args.policies is None else _names(args.policies)
    progress = PlanningBar(sys.stderr) if not args.no_progress else None
    profile = head_profile = None
    device = args.device
    if is_architecture(args.model):
        workload, profile = _architecture(args, policies, progress)
        device = device_spec(args.device)  # "cpu" too means the preset: the weights are fake

        def head_profile(tokens: int) -> Any:  # the same simulation with the loss head in chunks
            return _architecture(args, policies, progress, head_chunk_tokens=tokens)[1]

    else:
        workload = load_named_workload(args.model, architectures=True)
    try:
        result = plan(
            workload,
            batch=args.batch,
            memory=args.memory,
            world_size=args.world_size,
            blocks=blocks,
            policies=policies,
            trial=not args.no_trial,
            race=not args.no_race,
            progress=progress,
            min_micro_batch_size=args.min_micro_batch,
            even=args.even,
            prefer_large_micro_batches=args.prefer_large_micro_batches,
            profile=profile,
            head_profile=head_profile,
            device=device,
            simulate=args.simulate,
            shard=args.shard,
            gradient_sync=args.gradient_sync,
            pipeline=args.pipeline,
            pipeline_schedule=args.pipeline_schedule,
            max_grad_norm=args.max_grad_norm,
        )
    finally:
        if progress is not None:
            progress.close()
    if args.out:
        result.save(args.out)
    if args.plot:
        save_frontier_plot(result, args.plot)
    if args.json:
        print(dumps(result.to_dict()))
    else:
        print(result)
        if args.plot:
            print(f"frontier plot: {args.plot}")
        if args.out:
            print(f"plan saved: {args.out}")
    return 0
