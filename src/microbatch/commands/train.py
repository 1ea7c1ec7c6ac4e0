"""``microbatch train``: flags -> TrainConfig, a progress line on stderr, a summary (or --json) on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from typing import Any, TextIO

from .. import distributed
from ..errors import ConfigError
from ..memory import format_bytes
from ..models.gpt import GPT_SIZES
from ..planner import Plan
from ..training import DEFAULT_CPU_MEMORY, StepReport, TrainConfig, resume_config, train
from ..training.config import CHECKPOINT_POLICIES, DEFAULT_MAX_SKIPPED_WINDOWS, LR_SCALINGS, PRECISIONS
from ..training.elastic import restart_count
from ..training.max_tokens import parse_max_tokens
from ..training.run_folder import latest_run_dir
from ..training.run_plan import CUDA_FREE_MEMORY_FRACTION
from ..training.signals import exit_status
from . import quiet
from .output import dumps
from .progress import PlanningBar

_DEFAULTS = TrainConfig()
# Flags that map one to one onto TrainConfig fields (argparse dest == field name).
_CONFIG_FLAGS = (
    "pipeline",
    "pipeline_schedule",
    "model",
    "batch",
    "memory",
    "steps",
    "lr",
    "precision",
    "nominal_batch",
    "lr_scaling",
    "checkpoint_policy",
    "micro_batch",
    "plan",
    "out",
    "seed",
    "eval_interval",
    "checkpoint_interval",
    "device",
    "max_tokens",
)


EXIT_STATUS = (
    "Exit status: 0 the run finished; 2 a usage mistake (a flag, a plan or a budget that does not fit) "
    "or a training error such as non-finite gradients (-v/--verbose shows a traceback); 3 an internal "
    "error of microbatch; 128 + the signal's number when a signal stopped it (130 SIGINT / Ctrl-C, 143 "
    "by SIGTERM, 129 SIGHUP), the checkpoint saved and the resume command printed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Train the built-in byte-level GPT on the Python standard library's own source (nothing is "
        "downloaded), with the effective batch you ask for in the memory you have: microbatch plans "
        "the micro-batch size, accumulation steps and activation checkpointing, shows progress and "
        "writes runs/NAME/ (metrics.jsonl, plan.json, loss.png, summary.json, checkpoint.pt).\n\n"
        f"Memory budget without --memory: on CUDA {CUDA_FREE_MEMORY_FRACTION:.0%} of the GPU memory free "
        f"at start; on the CPU {DEFAULT_CPU_MEMORY} (the CPU has no allocator to ask and shares its "
        "RAM with everything else, so the default is a small, GPU-like budget under which the default "
        "run plans accumulation; pass --memory to use more).\n\n"
        "SIGINT (Ctrl-C), SIGTERM (a scheduler), SIGHUP (the terminal closed), SIGUSR1/2 or SIGXCPU "
        "finishes the optimizer step in progress, saves the checkpoint and summary.json, prints the "
        "resume command and exits 128 + the signal's number (130 / 143 / 129); a second signal "
        "stops at once (the last checkpoint stays intact). An out-of-memory error during training "
        "re-plans smaller and runs the same step again. "
        f"{DEFAULT_MAX_SKIPPED_WINDOWS} skipped optimizer steps in a row (non-finite gradients) stop "
        "the run with an error."
    )
    _add_run_arguments(parser.add_argument)
    _add_plan_arguments(parser.add_argument)
    _add_output_arguments(parser.add_argument)


def _add_run_arguments(add: Any) -> None:
    add(
        "--model",
        help=f"a built-in GPT size: {', '.join(GPT_SIZES)} (default {_DEFAULTS.model}); the same names "
        "work in microbatch plan and verify, which also take your own workload (package.module:function)",
    )
    add(
        "--batch",
        type=int,
        help=f"effective batch in sequences per optimizer step (default {_DEFAULTS.batch})",
    )
    add(
        "--memory",
        help=(
            "peak memory budget: a size (300MiB, 8GiB, whole bytes), or a fraction of the device's free "
            "memory at start: 80%% or a decimal in (0, 1] such as 0.5 (default: see above). On CUDA: peak "
            "reserved bytes of the caching allocator + what is measured outside it (context, workspaces, "
            "NCCL); on CPU: peak live tensor bytes"
        ),
    )
    add("--steps", type=int, help=f"optimizer steps in total (default {_DEFAULTS.steps})")
    add("--lr", type=float, help="peak learning rate (default: tuned per model size, e.g. 3e-3 for gpt-mini)")
    add("--precision", choices=list(PRECISIONS), help="fp32, or bf16 / fp16 autocast (fp16 with GradScaler)")
    add(
        "--nominal-batch",
        type=int,
        help="batch the lr and weight decay were tuned for: weight decay x batch/nominal, accumulation "
        "ramps up over the warmup (Ultralytics' nbs)",
    )
    add("--lr-scaling", choices=list(LR_SCALINGS), help="scale the lr from --nominal-batch to --batch")
    add("--seed", type=int, help=f"seed for the weights and the data order (default {_DEFAULTS.seed})")
    add("--device", help="torch device, e.g. cpu or cuda:1 (default: CUDA when there is one)")


def _add_plan_arguments(add: Any) -> None:
    add(
        "--checkpoint-policy",
        choices=list(CHECKPOINT_POLICIES),
        help="activation checkpointing: auto (the planner decides per block), or the one policy the "
        "planner may use (none, full, selective, selective-half); with --micro-batch, the policy of "
        "every block (default auto)",
    )
    add(
        "--micro-batch",
        type=int,
        help="choose the micro-batch size yourself (Plan.manual: no profiling, nothing predicted); "
        "steps = batch / micro-batch, rounded up",
    )
    add(
        "--pipeline",
        type=int,
        metavar="STAGES",
        help="cut the model into STAGES pipeline stages over the processes (torchrun; the world size "
        "must be a multiple: replicas x STAGES); gradients stay exact over every micro-batch (default 1)",
    )
    add(
        "--pipeline-schedule",
        choices=["gpipe", "1f1b", "interleaved-1f1b"],
        help="the pipeline schedule (torch.distributed.pipelining's; default 1f1b)",
    )
    add(
        "--plan",
        metavar="PLAN.json",
        help="use a saved plan (microbatch plan ... --out, or a run's plan.json)",
    )
    add(
        "--no-trial",
        dest="trial",
        action="store_false",
        default=None,
        help="do not prove the plan in a real trial window (planner or --plan)",
    )


def _add_output_arguments(add: Any) -> None:
    add("--out", help="run folder (default runs/MODEL-DATE-TIME; with --resume, the latest run in runs/)")
    add(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint (--steps may grow)",
    )
    add("--eval-interval", type=int, help="steps between validation losses (default steps/5, at most 50)")
    add("--checkpoint-interval", type=int, help="steps between checkpoints (default max(eval interval, 50))")
    add(
        "--max-tokens",
        type=parse_max_tokens,
        help="micro-batches by padded tokens instead of rows: N, auto (the plan's micro-batch x block size; "
        "the default) or off (fixed rows); the same gradient with less padding",
    )
    add("--json", action="store_true", help="print the summary as JSON on stdout")
    add("--no-progress", action="store_true", help="no progress bars on stderr (planning, training)")


def _format_seconds(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLine:
    """One line redrawn with \\r on a terminal; elsewhere a plain line every tenth of the run.

    A validation loss computed at an earlier step is marked with that step ("val 3.142 (step 40)"),
    and so is a peak measured at an earlier step; the peak says which micro-batches it is of, since
    training's token-budget micro-batches usually peak below the plan's trial window of full rows.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self.last_val: tuple[int, float] | None = None  # (step, validation loss)
        self.width = 0

    def __call__(self, report: StepReport) -> None:
        self._write(report, self.format(report))

    def format(self, report: StepReport) -> str:
        if report.val_loss is not None:
            self.last_val = (report.step, report.val_loss)
        filled = int(20 * report.step / report.total_steps)
        val = ""
        if self.last_val is not None:
            val_step, val_loss = self.last_val
            val = f" | val {val_loss:.3f}" + (f" (step {val_step})" if val_step != report.step else "")
        return (
            f"step {report.step}/{report.total_steps} [{'#' * filled}{'.' * (20 - filled)}] "
            f"loss {report.loss:.3f}{val} | {report.tokens_per_second:,.0f} tok/s | lr {report.lr:.2e} | "
            f"peak {format_bytes(report.peak_bytes)}{_peak_words(report)} | "
            f"ETA {_format_seconds(report.eta_seconds)}"
        )

    def _write(self, report: StepReport, line: str) -> None:
        # A failed write (a hang-up, a full disk, a closed pipe) is dropped: output never costs training.
        if self.live:
            text = "\r" + line.ljust(self.width) + ("\n" if report.step == report.total_steps else "")
            self.width = len(line)
            quiet.write(self.stream, text)
        elif report.step == report.total_steps or report.step % max(1, report.total_steps // 10) == 0:
            quiet.write(self.stream, line + "\n")

    def close(self) -> None:
        if self.live and self.width:
            quiet.write(self.stream, "\n")
            self.width = 0


def _peak_words(report: StepReport) -> str:
    """' (step 50, micro-batches of <= 8192 tokens)': when the peak was measured and of what."""
    words = [f"step {report.peak_step}"] if report.peak_step not in (None, report.step) else []
    words += [report.peak_what] if report.peak_what else []
    return f" ({', '.join(words)})" if words else ""


def build_config(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from the flags; with --resume, the run's saved config with the flags given on top."""
    given = {name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name) is not None}
    if args.trial is not None:
        given["trial"] = args.trial
    if args.resume:
        run_dir = given.pop("out", None) or latest_run_dir()
        config = resume_config(run_dir, **given)
        if "plan" in given and "micro_batch" not in given and config.micro_batch is not None:
            raise ConfigError(
                f"--plan: the run in {run_dir!r} was started with --micro-batch {config.micro_batch}, which "
                "fixes how it splits the batch; resume it without --plan, or start a new run with --plan"
            )
        return config
    return dataclasses.replace(_DEFAULTS, **given)


def _maybe_init_distributed() -> bool:
    """Join the process group torchrun describes in the environment; True if this call created it."""
    if distributed.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # torchrun keeps one store across restarts (--max-restarts): the ranks' addresses of an earlier
    # attempt are still in it, and restarted ranks would try to connect to processes that are gone.
    # Each attempt gets keys of its own.
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = dist.PrefixStore(f"microbatch/attempt-{restart_count()}", store)
    dist.init_process_group(backend=backend, store=attempt, rank=rank, world_size=world_size)
    return True


def _resume_command(summary_run_dir: str) -> str:
    return f"microbatch train --resume --out {shlex.quote(summary_run_dir)}"


def run(args: argparse.Namespace) -> int:
    created_group = _maybe_init_distributed()
    try:
        return _run(args)
    finally:
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    config = build_config(args)
    rank_zero = distributed.is_rank_zero()
    progress = ProgressLine(sys.stderr) if rank_zero and not args.no_progress else None
    planning = PlanningBar(sys.stderr) if rank_zero and not args.no_progress else None
    started = time.perf_counter()
    try:
        summary = train(config, progress=progress, plan_progress=planning)
    finally:
        if progress is not None:
            progress.close()
    status = exit_status(summary.stopped_by) if summary.interrupted else 0
    if not rank_zero:
        return status
    # The run folder holds the record; a stdout or stderr that is gone does not change the status.
    if args.json:
        output: dict[str, Any] = summary.to_dict()
        output["wall_seconds"] = time.perf_counter() - started
        quiet.write(sys.stdout, dumps(output, sort_keys=True) + "\n")
    else:
        quiet.write(sys.stdout, f"{summary}\nplan: {Plan.from_dict(summary.plan).headline()}\n")
    if summary.interrupted:
        quiet.write(
            sys.stderr,
            f"microbatch train: {summary.stopped_by or 'interrupted'} at step "
            f"{summary.steps_done}/{summary.total_steps}; checkpoint "
            f"saved in {summary.checkpoint}. Resume with: {_resume_command(summary.run_dir)}\n",
        )
    return status
