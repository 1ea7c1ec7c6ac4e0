"""Planner: the plan's measured time per optimizer step against the usual ways to fit a batch.

On the built-in GPT, for budgets swept from the least any plan needs to the peak of one
no-checkpoint micro-batch of the whole batch, each configuration trains full windows of exactly
B samples (uneven last micro-batch where needed) and is timed:

    plan   mb.plan(workload, batch=B, memory=M): its micro-batch, steps and per-block policies
    (a)    no checkpointing, the largest micro-batch that fits, found as Accelerate's
           find_executable_batch_size does: start at B, x0.9 after each failure
    (b)    every block checkpointed (full; HF gradient_checkpointing), largest micro-batch, same finder
    (c)    torch.utils.checkpoint.checkpoint_sequential over the blocks with round(sqrt(L)) segments,
           largest micro-batch, same finder

"Fits" means the measured peak (MemoryTracker over a window's first two micro-batches and the
optimizer step: the window's peak) is <= M, the CPU stand-in for "does not run out of memory".
Peaks are measured once per (configuration, micro-batch) and shared across budgets. Times are
the fastest of rounds in which every distinct configuration (each on its own model copy, set up
once, as in training) runs one window in turn, so a slow moment of a shared machine hits all of
them; the noise floor is the largest disagreement of a plan configuration with itself, timed on
two model copies (A/A).

Targets: plan never slower than the fastest baseline that fits (ratio <= 1.00 within noise); at
mid budgets >= 1.15x faster than (b); feasible where (a) is not; measured peak <= budget at every
point; planning (profile + solve + trial) under 60 s on 2 CPU cores; the plan's predicted s/step
within 15 % of its measured s/step at every budget.

``--clock cpu`` times the profile and every window by the CPU time of the one torch thread
(profile/clocks.py): on a machine other jobs share, wall-clock seconds hold their time slices too,
which differ between the moment of the profile and that of each window.

    python benchmarks/planner.py [--model gpt-mini] [--batch 64] [--budgets 8] [--rounds 15]
                                 [--threads N] [--clock wall|cpu] [--quick] [--json] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import microbatch as mb
import results
from microbatch.checkpointing.api import checkpoint
from microbatch.memory import format_bytes
from microbatch.models.gpt import GPT
from microbatch.models.workloads import gpt_workload
from microbatch.planner import Plan, plan
from microbatch.planner.proof.trial_run import run_trial
from microbatch.planner.result.plot import save_frontier_plot
from microbatch.planner.search.sizes import Candidate, Model, search
from microbatch.profile import Profile, profile_workload
from microbatch.trees.batches import micro_batch_sizes
from microbatch.workload import Workload

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Config:
    """A way to run a window: micro-batch sizes and how the blocks are checkpointed."""

    kind: str  # "plan", "a", "b", "c"
    sizes: tuple[int, ...]
    policies: tuple[tuple[str, str], ...] = ()  # for "plan", "a", "b"

    @property
    def label(self) -> str:
        return f"{self.sizes[0]} x {len(self.sizes)}"


def setup(model: nn.Module, config: Config, blocks: list[str]) -> Callable[[], None]:
    """Set ``model`` up as ``config`` says (checkpoint its blocks, or patch its forward); returns the undo."""
    if config.kind == "c":
        if not isinstance(model, GPT):
            raise TypeError("the checkpoint_sequential baseline needs the built-in GPT")
        segments = max(1, round(math.sqrt(len(blocks))))

        def forward(idx: torch.Tensor) -> torch.Tensor:  # GPT.forward with the blocks in segments
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = model.dropout(model.token_embedding(idx) + model.position_embedding(positions))
            x = checkpoint_sequential(model.blocks, segments, x, use_reentrant=False)
            return model.lm_head(model.ln_f(x))  # type: ignore[no-any-return]

        model.forward = forward  # type: ignore[method-assign]
        return lambda: model.__dict__.pop("forward", None)
    policies = dict(config.policies)
    if any(policy != "none" for policy in policies.values()):
        return checkpoint(model, policy=policies).remove
    return lambda: None


@contextlib.contextmanager
def applied(model: nn.Module, config: Config, blocks: list[str]) -> Iterator[None]:
    undo = setup(model, config, blocks)
    try:
        yield
    finally:
        undo()


def measured_peak(workload: Workload, config: Config, blocks: list[str]) -> int:
    """Peak of the window's first two micro-batches and its step, as the planner's trial measures it.

    A fresh setup each time: the first window of a training run, the one that peaks highest.
    """
    with applied(workload.model, config, blocks):
        # run_trial applies a plan's own policies; here the model is already set up.
        candidate = Candidate(
            micro_batch_sizes=config.sizes, block_policies=(), peak_bytes=0, seconds_per_step=0.0
        )
        return run_trial(workload, candidate).peak_bytes


class Runner:
    """One configuration's own copy of the model, set up once, with its own optimizer: as in training."""

    def __init__(self, workload: Workload, config: Config, blocks: list[str]) -> None:
        self.workload, self.config = workload, config
        self.model = copy.deepcopy(workload.model)
        setup(self.model, config, blocks)
        self.optimizer = (
            workload.optimizer(self.model)
            if workload.optimizer
            else torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        )

    def window(self) -> tuple[float, float]:
        """Wall and this thread's CPU seconds for one optimizer step: N micro-batches (made
        beforehand) and the step."""
        batches = [self.workload.make_batch(size) for size in self.config.sizes]
        accumulator = mb.Accumulator(self.model, self.optimizer, steps=len(batches))
        began, began_cpu = time.perf_counter(), time.thread_time()
        for micro in accumulator.iterate(batches):
            loss, items = self.workload.loss(self.model, micro.batch)
            accumulator.backward(loss, items=items)
            if micro.is_last:
                accumulator.step()
        return time.perf_counter() - began, time.thread_time() - began_cpu


class Extended:
    """A plan's predicted s/step as mb.plan gives it: a micro-batch beyond the profiled sizes is
    priced from a profile extended up to it (sizes 1, b / 2, b), as plan() does when it profiles
    itself; here one profile serves every budget, so the extension is made here, once per size."""

    def __init__(self, workload: Workload, profile: Profile, *, clock: str) -> None:
        self.workload, self.profile, self.clock = workload, profile, clock
        self.profiles: dict[int, Profile] = {}

    def seconds(self, chosen: Plan) -> float:
        size = chosen.micro_batch_sizes[0]
        if size <= max(self.profile.micro_batch_sizes):
            return chosen.predicted_seconds_per_step
        if size not in self.profiles:
            self.profiles[size] = profile_workload(self.workload, max_micro_batch_size=size, clock=self.clock)
        model = Model(self.profiles[size])
        return model.evaluate(list(chosen.micro_batch_sizes), dict(chosen.block_policies)).seconds_per_step


def finder_sizes(batch: int) -> list[int]:
    """Accelerate's find_executable_batch_size sequence: B, then int(0.9 x previous), down to 1."""
    sizes = [batch]
    while sizes[-1] > 1:
        sizes.append(max(1, int(sizes[-1] * 0.9)))
    return sizes


class Peaks:
    """Measured peaks per (kind, micro-batch), shared by every budget."""

    def __init__(self, workload: Workload, blocks: list[str], batch: int) -> None:
        self.workload, self.blocks, self.batch = workload, blocks, batch
        self.cache: dict[tuple[str, int], int] = {}

    def config(self, kind: str, size: int) -> Config:
        policy = {"a": "none", "b": "full", "c": "none"}[kind]
        return Config(
            kind, tuple(micro_batch_sizes(self.batch, size)), tuple((n, policy) for n in self.blocks)
        )

    def peak(self, kind: str, size: int) -> int:
        if (kind, size) not in self.cache:
            self.cache[kind, size] = measured_peak(self.workload, self.config(kind, size), self.blocks)
        return self.cache[kind, size]

    def largest_that_fits(self, kind: str, budget: int) -> Config | None:
        for size in finder_sizes(self.batch):
            if self.peak(kind, size) <= budget:
                return self.config(kind, size)
        return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    workload = gpt_workload(args.model)
    batch = args.batch
    began = time.perf_counter()
    profile = profile_workload(workload, max_micro_batch_size=min(batch, 16), clock=args.clock)
    profile_seconds = time.perf_counter() - began
    blocks = [segment.name for segment in profile.blocks]
    minimum = search(profile, per_rank_batch=batch, capacity_bytes=math.inf).minimum.peak_bytes
    peaks = Peaks(workload, blocks, batch)
    top = peaks.peak("a", batch)
    budgets = [round(minimum + i * (top - minimum) / (args.budgets - 1)) for i in range(args.budgets)]

    points: list[dict[str, Any]] = []
    plans: dict[int, Plan] = {}
    extended = Extended(workload, profile, clock=args.clock)
    for budget in budgets:
        started = time.perf_counter()
        try:
            chosen = plan(workload, batch=batch, memory=budget, profile=profile)
        except mb.MicrobatchError as error:
            points.append({"budget_bytes": budget, "plan_error": str(error)})
            continue
        plans[budget] = chosen
        point: dict[str, Any] = {
            "budget_bytes": budget,
            "plan": Config("plan", chosen.micro_batch_sizes, chosen.block_policies),
            "plan_solve_and_trial_seconds": time.perf_counter() - started,
            "plan_predicted_peak_bytes": chosen.predicted_peak_bytes,
            "plan_measured_peak_bytes": chosen.measured_peak_bytes,
            "plan_predicted_seconds": extended.seconds(chosen),
            "plan_predicted_seconds_from_16": chosen.predicted_seconds_per_step,
            "plan_policies": chosen.policies,
        }
        for kind in ("a", "b", "c"):
            point[kind] = peaks.largest_that_fits(kind, budget)
        points.append(point)

    # Time every distinct configuration, interleaved round by round.
    distinct: list[Config] = []
    for point in points:
        for kind in ("plan", "a", "b", "c"):
            config = point.get(kind)
            if isinstance(config, Config) and config not in distinct:
                distinct.append(config)
    # The noise floor: every plan configuration once more, on its own runner (A/A pairs).
    plan_configs = [config for config in distinct if config.kind == "plan"]
    twins = {config: Config("A/A", config.sizes, config.policies) for config in plan_configs}
    timed = distinct + list(twins.values())
    seconds: dict[Config, list[float]] = {config: [] for config in timed}
    wall: dict[Config, list[float]] = {config: [] for config in timed}
    runners = {config: Runner(workload, config, blocks) for config in timed}
    for runner in runners.values():  # warm-up: optimizer state, a checkpoint's first (learning) call
        runner.window()
    for _ in range(args.rounds):
        for config, runner in runners.items():
            wall_seconds, cpu_seconds = runner.window()
            seconds[config].append(cpu_seconds if args.clock == "cpu" else wall_seconds)
            wall[config].append(wall_seconds)
    # Other jobs on a shared machine only ever add time: the fastest window is the configuration's
    # cost; medians are in the JSON.
    fastest = {config: min(values) for config, values in seconds.items()}
    median = {config: statistics.median(values) for config, values in seconds.items()}
    disagreement = {config: abs(fastest[twin] / fastest[config] - 1) for config, twin in twins.items()}
    noisiest = max(disagreement, key=disagreement.__getitem__, default=None)

    # A full plan from scratch (profile + solve + trial), as a user runs it.
    fresh = gpt_workload(args.model)
    started = time.perf_counter()
    plan(fresh, batch=batch, memory=budgets[len(budgets) // 2])
    planning_seconds = time.perf_counter() - started

    rows = []
    for point in points:
        row: dict[str, Any] = {"budget_bytes": point["budget_bytes"]}
        if "plan_error" in point:
            row["plan_error"] = point["plan_error"]
            rows.append(row)
            continue
        own = point["plan"]
        row.update({k: v for k, v in point.items() if k.startswith("plan_")})
        row["plan_micro_batch"] = own.label
        row["plan_seconds"] = fastest[own]
        row["plan_median_seconds"] = median[own]
        row["plan_wall_seconds"] = min(wall[own])
        # The time model's error: predicted over measured seconds per step, in the profile's clock.
        row["predicted_over_measured"] = point["plan_predicted_seconds"] / fastest[own]
        for kind in ("a", "b", "c"):
            config = point[kind]
            row[f"{kind}_micro_batch"] = config.label if config else None
            row[f"{kind}_seconds"] = fastest[config] if config else None
            row[f"{kind}_median_seconds"] = median[config] if config else None
            row[f"{kind}_peak_bytes"] = peaks.peak(kind, config.sizes[0]) if config else None
        fitting = [row[f"{kind}_seconds"] for kind in ("a", "b", "c") if row[f"{kind}_seconds"] is not None]
        row["ratio_to_best_baseline"] = fastest[own] / min(fitting) if fitting else None
        row["speedup_over_b"] = row["b_seconds"] / fastest[own] if row["b_seconds"] else None
        rows.append(row)

    plot_plan = plans.get(budgets[len(budgets) // 2]) or next(iter(plans.values()), None)
    return {
        "model": args.model,
        "batch": batch,
        "blocks": len(blocks),
        "rows": rows,
        "profile_seconds": profile_seconds,
        "planning_seconds": planning_seconds,
        "minimum_bytes": minimum,
        "noise": disagreement[noisiest] if noisiest is not None else None,
        "noise_configuration": noisiest.label if noisiest is not None else None,
        "noise_pairs": len(disagreement),
        "rounds": args.rounds,
        "clock": args.clock,
        "no_checkpoint_peak_bytes": top,
        "plot_plan": plot_plan,
        "plot_baselines": _baselines_for_plot(rows, plot_plan),
    }


def _baselines_for_plot(rows: list[dict[str, Any]], chosen: Plan | None) -> list[tuple[str, float, float]]:
    """The measured points at the plotted plan's budget: the plan itself and the baselines that fit."""
    if chosen is None:
        return []
    row = next(r for r in rows if r.get("budget_bytes") == chosen.budget_bytes)
    names = {"a": "(a) no checkpointing", "b": "(b) all blocks full", "c": "(c) checkpoint_sequential"}
    points = [
        (f"plan {row['plan_micro_batch']} (measured)", row["plan_seconds"], row["plan_measured_peak_bytes"])
    ]
    points += [
        (f"{names[k]} {row[f'{k}_micro_batch']} (measured)", row[f"{k}_seconds"], row[f"{k}_peak_bytes"])
        for k in ("a", "b", "c")
        if row[f"{k}_seconds"] is not None
    ]
    return points


def _cell(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any], command: str, load: str) -> str:
    rows = report["rows"]
    table = []
    for row in rows:
        if "plan_error" in row:
            table.append([format_bytes(row["budget_bytes"]), "no plan", "", "", "", "", "", "", "", ""])
            continue
        policies = ", ".join(
            f"{p} x{list(row['plan_policies'].values()).count(p)}"
            for p in dict.fromkeys(row["plan_policies"].values())
        )
        table.append(
            [
                format_bytes(row["budget_bytes"]),
                f"{row['plan_micro_batch']} ({policies})",
                format_bytes(row["plan_predicted_peak_bytes"])
                + " / "
                + format_bytes(row["plan_measured_peak_bytes"]),
                _cell(row["plan_seconds"]),
                f"{_cell(row['plan_predicted_seconds'])} / {_cell(row['plan_seconds'])} "
                f"(**{row['predicted_over_measured']:.2f}**)",
                *(
                    f"{row[f'{k}_micro_batch']}: {_cell(row[f'{k}_seconds'])}"
                    if row[f"{k}_seconds"]
                    else "does not fit"
                    for k in ("a", "b", "c")
                ),
                f"**{_cell(row['ratio_to_best_baseline'], 2)}**" if row["ratio_to_best_baseline"] else "n/a",
                _cell(row["speedup_over_b"], 2) + "x" if row["speedup_over_b"] else "n/a",
            ]
        )
    headers = [
        "budget",
        "plan: micro x steps (policies)",
        "plan peak predicted / measured",
        "plan s/step",
        "plan s/step predicted / measured (ratio)",
        "(a) none, x0.9 finder",
        "(b) all full, x0.9 finder",
        "(c) checkpoint_sequential",
        "plan / best fitting baseline",
        "(b) / plan",
    ]
    fitted = [r for r in rows if "plan_error" not in r]
    within = sum(r["plan_measured_peak_bytes"] <= r["budget_bytes"] for r in fitted)
    a_fails = sum(r["a_seconds"] is None for r in fitted)
    noise = report["noise"] or 0.0
    worst = max((r["ratio_to_best_baseline"] or 0.0 for r in fitted), default=0.0)
    model_errors = [r["predicted_over_measured"] for r in fitted]
    within_15 = sum(abs(ratio - 1) <= 0.15 for ratio in model_errors)
    clock = (
        "CPU time of the one torch thread (profile and windows alike: other jobs' time slices on the "
        "shared machine do not count; the wall-clock times are in the JSON)"
        if report["clock"] == "cpu"
        else "wall-clock time"
    )
    over = sum((r["ratio_to_best_baseline"] or 0.0) > 1 + noise for r in fitted)
    middle = fitted[len(fitted) // 4 : max(len(fitted) // 4 + 1, 3 * len(fitted) // 4)]
    mid_speedups = [r["speedup_over_b"] for r in middle if r["speedup_over_b"]]
    lines = [
        f"Built-in GPT `{report['model']}` ({report['blocks']} blocks), effective batch {report['batch']}, "
        f"budgets from the least any plan needs ({format_bytes(report['minimum_bytes'])}) to the peak of "
        f"one no-checkpoint micro-batch of {report['batch']} "
        f"({format_bytes(report['no_checkpoint_peak_bytes'])}). "
        "Seconds per optimizer step are measured: every configuration trains full windows of exactly B "
        f"samples on its own model copy, interleaved over {report['rounds']} rounds, and its fastest "
        "window counts (other jobs on the shared machine only add time; medians are in the JSON). "
        'A baseline "fits" when its measured peak is <= the budget.',
        "",
        results.markdown_table(headers, table),
        "",
        f"- Measured peak <= budget at **{within} of {len(fitted)}** points"
        + (f"; no plan at {len(rows) - len(fitted)} budget(s)." if len(rows) > len(fitted) else "."),
        f"- Plan / fastest fitting baseline: worst **{worst:.2f}**; noise floor of this run "
        f"{noise:.1%}: the largest disagreement of a plan configuration with itself on a second "
        f"model copy ({report['noise_pairs']} A/A pairs; worst at {report['noise_configuration']}). "
        f"Rows over 1.00 + noise: {over}.",
        f"- Time model: predicted / measured s/step of the plan from {min(model_errors, default=0):.2f} "
        f"to {max(model_errors, default=0):.2f}; within 15 % at **{within_15} of {len(fitted)}** budgets. "
        f"Seconds are {clock}. A plan of micro-batches beyond the profiled 16 is priced from a profile "
        "extended up to them, as `mb.plan` does when it profiles itself (`plan_predicted_seconds_from_16` "
        "in the JSON: from the sweep's one profile).",
        f"- (b) / plan at mid budgets: {', '.join(f'{s:.2f}x' for s in mid_speedups) or 'n/a'}.",
        f"- Budgets where (a) no-checkpoint does not fit at any micro-batch and the plan does: {a_fails}.",
        f"- Planning from scratch (profile + solve + trial): **{report['planning_seconds']:.1f} s**; "
        f"the profile alone {report['profile_seconds']:.1f} s.",
        "",
        "Frontier at the mid budget (predicted peaks and times), with the plan and the baselines as "
        "measured at that budget (the profile's times run through its micro-batches 1, 8 and 16 and beyond "
        "them along the least-squares slope): ![frontier](frontier.png)",
        "",
        f"Measured on: {results.environment_line()}; torch threads {torch.get_num_threads()}; "
        f"load average {load} (the machine is shared).",
        "",
        f"Command: `{command}`",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budgets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time profile and windows by wall clock, or by the CPU time of one torch thread "
        "(a shared machine; implies --threads 1)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small batch, few budgets and rounds"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (title, markdown, numbers)")
    parser.add_argument(
        "--no-write", action="store_true", help="leave benchmarks/RESULTS.md and the plot alone"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.budgets, args.rounds = min(args.batch, 16), min(args.budgets, 3), min(args.rounds, 1)
    if args.clock == "cpu":
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = measure(args)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    command = "python benchmarks/planner.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(report, command.strip(), load)
    plot_plan: Plan | None = report.pop("plot_plan")
    write = not (args.no_write or args.quick)
    if write and plot_plan is not None:  # the image, also under `microbatch bench`
        save_frontier_plot(
            plot_plan,
            str(HERE / "frontier.png"),
            title=(
                f"{report['model']}, batch {report['batch']}: "
                f"frontier at budget {format_bytes(plot_plan.budget_bytes)}"
            ),
            baselines=report.pop("plot_baselines"),
        )
    report.pop("plot_baselines", None)
    report["environment"] = results.environment()
    return results.emit("Planner", text, report, json_mode=args.json, write=write)


if __name__ == "__main__":
    sys.exit(main())
