"""Planner on real models: the plan against the strategies a user picks by hand (issue 32).

Per model (gpt-mini, transformers Llama / GPT-2 / BERT from tiny configs, random weights) and budget,
at batch B:

    tight   1.15 x the predicted peak of every block checkpointed (full) at micro-batch 1
    loose   the predicted peak of no checkpointing at the whole batch
    mid     halfway between
    mb2-3   halfway between the no-checkpoint peaks at micro-batch 2 and 3 (vision_real.py's budget,
            the issue's torchvision rows; at 32 px "tight" admits resnet50's whole batch unchecked)

each cell holds:

    plan    mb.plan(workload, batch=B, memory=budget) made from scratch: its planning seconds (wall)
    hands   the hand strategies of search/hand.py (no checkpointing, every block full,
            checkpoint_sequential-like segments), each at the largest micro-batch whose *measured*
            peak fits the budget (the profile's prediction first, one size down until it fits)

Every configuration trains whole windows of B samples (same loop: the Accumulator, the workload's
optimizer), in turn, ``--rounds`` rounds (each round in a rotated order, each timed window after an
untimed one of the same configuration), on one torch thread timed by its CPU clock
(time.thread_time: other processes on a shared machine do not inflate it). Ratio = plan / best
hand per round, the best hand being the strategy with the fastest median window (paired rounds),
reported as median [min, max] over rounds; peak = MemoryTracker over one window and its step,
against the budget. Targets (issue 32): every cell's median ratio <= 1.03, the median over cells
<= 0.97, every measured peak <= budget.
The closest peer, torchtitan's budgeted activation-memory policy (PR #4636), reports +5.2 to +5.8 %
tokens/s over checkpointing every layer: compare the "vs every block full" column.

    python benchmarks/planner_real.py [--models gpt-mini,tiny-llama,tiny-gpt2,tiny-bert]
                                      [--budgets tight,mid,loose] [--batch 32] [--rounds 5] [--json]
                                      [--save report.json]

torchvision models (resnet50, efficientnet_b0, convnext_tiny, swin_t, deeplabv3_mobilenet_v3_large,
deeplabv3_resnet50: vision_real.py's builders, weights=None, random --image px images) need
torchvision, which does not install beside the project's torch pin: run them with the venv of
vision_real.py's docstring and PYTHONPATH=src:benchmarks (no editable install). Their results go to
the section "<title> (torchvision)", so they and the language models' run do not overwrite each
other. A model with BatchNorm gets min_micro_batch_size=2 (at 32 px resnet50's last stage is 1 x 1:
a micro-batch of 1 leaves BatchNorm one value per channel), passed alike to mb.plan, to the hand
strategies' sizes and to the tight budget's micro-batch, so all are compared under the same rule.
``--save PATH`` rewrites the JSON report after every cell (and the section, unless --json or
--no-write), so a run cut short keeps the cells it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import microbatch as mb
import results
from microbatch.accumulate.accumulator import Accumulator
from microbatch.checkpointing.api import checkpoint
from microbatch.memory import MemoryTracker, format_bytes
from microbatch.models.workloads import gpt_workload
from microbatch.planner import Plan
from microbatch.planner.result.plans import summarize_policies
from microbatch.planner.search.hand import hand_strategies
from microbatch.planner.search.pricing import Model
from microbatch.planner.search.splits import WindowSizes
from microbatch.profile import NONE, profile_workload
from microbatch.profile.runs import train_window

SECTION_TITLE = "Planner on real models: plan vs hand strategies"
VISION_MODELS = (
    "resnet50",
    "efficientnet_b0",
    "convnext_tiny",
    "swin_t",
    "deeplabv3_mobilenet_v3_large",
    "deeplabv3_resnet50",
)
VISION_SUFFIX = " (torchvision)"
Config = tuple[tuple[int, ...], dict[str, str]]  # micro-batch sizes, policy per block


def workload(name: str, image: int) -> mb.Workload:
    """The named workload; torchvision (and transformers) imported only for the models that need it."""
    if name in VISION_MODELS:
        import vision_real

        if vision_real.torchvision is None:
            raise SystemExit(
                f"--models {name} needs torchvision: run in the venv of vision_real.py's docstring"
            )
        return vision_real.make_workload(name, image)
    makers = language_workloads()
    if name not in makers:
        raise SystemExit(f"--models: unknown model {name!r}; choose from {[*makers, *VISION_MODELS]}")
    return makers[name]()


def min_micro_batch(work: mb.Workload) -> int:
    """2 for a model with BatchNorm (one sample leaves it one value per channel at a 1 x 1 map), else 1."""
    norms = torch.nn.modules.batchnorm._BatchNorm
    return 2 if any(isinstance(module, norms) for module in work.model.modules()) else 1


def language_workloads() -> dict[str, Callable[[], mb.Workload]]:
    def bert() -> mb.Workload:
        # A masked LM: 15 % of the tokens masked (id 0) and predicted; the loss is the mean over them.
        from microbatch.hf import tiny_bert

        model = tiny_bert(num_layers=4, hidden_size=64, num_heads=4, max_length=64)
        generator = torch.Generator().manual_seed(0)

        def make_batch(size: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(1, 256, (size, 64), generator=generator)
            masked = torch.rand(size, 64, generator=generator) < 0.15
            masked[:, 0] = True  # at least one predicted token per row
            return {"input_ids": ids.masked_fill(masked, 0), "labels": ids.masked_fill(~masked, -100)}

        def loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
            labels = batch["labels"]
            return module(**batch).loss, (labels != -100).sum()

        adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)  # noqa: E731
        return mb.Workload(model, make_batch, loss, optimizer=adamw, name="tiny-bert")

    from microbatch.hf import tiny_gpt2_workload, tiny_llama_workload

    return {
        "gpt-mini": lambda: gpt_workload("gpt-mini"),
        "tiny-llama": tiny_llama_workload,
        "tiny-gpt2": tiny_gpt2_workload,
        "tiny-bert": bert,
    }


def config_policies(config: Config | Plan) -> dict[str, str]:
    return dict(config.block_policies) if isinstance(config, Plan) else config[1]


def config_sizes(config: Config | Plan) -> tuple[int, ...]:
    return tuple(config.micro_batch_sizes) if isinstance(config, Plan) else config[0]


def window_seconds(
    work: mb.Workload,
    config: Config | Plan,
    optimizer: torch.optim.Optimizer,
    batches: list[Any] | None = None,
) -> float:
    """One whole window of ``config`` (a Plan: as ``plan.apply`` runs it, its exact levers included)
    on the workload's model, timed by the thread's CPU clock. ``batches``: the window's micro-batches,
    made here when not given."""
    plan = config if isinstance(config, Plan) else None
    policies = {} if plan is not None else config[1]
    recomputes = any(p != NONE for p in policies.values())
    handle = checkpoint(work.model, policy=policies) if recomputes else None
    try:
        if batches is None:
            batches = [work.make_batch(size) for size in config_sizes(config)]
        if plan is not None:
            accumulator = plan.apply(work.model, optimizer)
        else:
            accumulator = Accumulator(work.model, optimizer, steps=len(batches))
        started = time.thread_time()
        train_window(work, accumulator, handed(batches))
        return time.thread_time() - started
    finally:
        if handle is not None:
            handle.remove()
        if plan is not None:
            plan.remove(work.model)
        work.model.zero_grad(set_to_none=True)


def handed(batches: list[Any]) -> Iterator[Any]:
    """The micro-batches one at a time, each dropped after its turn, as a data loader hands them over
    (and the planner's trial): iterating the list instead keeps every micro-batch of the window alive
    to its end, which the tracker counts (efficientnet_b0 at 8 x 4: 98,368 bytes of input a
    micro-batch, its window read 39.30 MB where the trial's 39.00 MB is what training holds)."""
    while batches:
        yield batches.pop(0)


def window_peak(work: mb.Workload, config: Config | Plan, optimizer: torch.optim.Optimizer) -> int:
    """The tracked peak of one window and its step. The micro-batches are made before the tracker
    starts, as a data loader hands them over: made inside, the tracker would count the whole corpus
    a batch is sliced from (gpt-mini's 3.8 MB of text) as a live tensor of the window."""
    batches = [work.make_batch(size) for size in config_sizes(config)]
    with MemoryTracker(torch.device("cpu"), model=work.model, optimizer=optimizer) as tracker:
        window_seconds(work, config, optimizer, batches)
    return int(tracker.peak_bytes)


def window_sizes(batch: int, size: int, floor: int) -> WindowSizes:
    """Micro-batches of ``size``, the rest in the last; shared evenly when that last is under ``floor``
    (and in one step fewer while still under it: 7 at 2 with a floor of 2 is 3 + 2 + 2)."""
    sizes = WindowSizes(batch, size)
    while sizes.last < floor and size < batch:
        sizes = WindowSizes(batch, size, balanced=True)
        size += 1
    return sizes


def budgets(model: Model, names: list[str], batch: int, floor: int) -> dict[str, int]:
    full = {segment.name: "full" for segment in model.profile.blocks}
    tight = int(1.15 * model.evaluate(window_sizes(batch, floor, floor), full).peak_bytes)
    loose = int(model.evaluate(WindowSizes(batch, batch), {}).peak_bytes)
    # vision_real.py's budget (the torchvision rows): halfway between the no-checkpoint
    # peaks at micro-batch 2 and 3 (or the floor and one above), where "tight" may admit the whole
    # batch (32 px images: the weights and optimizer outweigh the activations)
    low = max(floor, 2)
    between = [model.evaluate(window_sizes(batch, size, floor), {}).peak_bytes for size in (low, low + 1)]
    found = {"tight": tight, "mid": (tight + loose) // 2, "loose": loose, "mb2-3": sum(between) // 2}
    return {name: found[name] for name in names}


def hand_configs(
    work: mb.Workload, model: Model, batch: int, budget: int, optimizer: torch.optim.Optimizer, floor: int
) -> dict[str, tuple[Config, int]]:
    """Each hand strategy at the largest micro-batch whose measured peak fits: (config, peak)."""
    found: dict[str, tuple[Config, int]] = {}
    for name, policies in hand_strategies(model.profile):
        named = {segment.name: policies.get(segment.name, NONE) for segment in model.profile.blocks}
        fitting = [
            b
            for b in range(batch, floor - 1, -1)
            if model.evaluate(window_sizes(batch, b, floor), named).peak_bytes <= budget
        ]
        start = fitting[0] if fitting else floor
        for b in range(min(batch, start + 1), floor - 1, -1):  # the prediction's size (and one above), down
            config: Config = (tuple(window_sizes(batch, b, floor)), named)
            peak = window_peak(work, config, optimizer)
            if peak <= budget:
                found[name] = (config, peak)
                break
    return found


def cell(work: mb.Workload, model: Model, batch: int, budget: int, rounds: int, floor: int) -> dict[str, Any]:
    optimizer = work.make_optimizer()
    started = time.perf_counter()
    plan = mb.plan(work, batch=batch, memory=budget, min_micro_batch_size=floor)
    planning_seconds = time.perf_counter() - started
    window_seconds(work, plan, optimizer)  # the optimizer's state exists from here on, as in training
    plan_peak = window_peak(work, plan, optimizer)
    hands = hand_configs(work, model, batch, budget, optimizer, floor)
    configs: dict[str, Config | Plan] = {
        "plan": plan,
        **{name: config for name, (config, _) in hands.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_index in range(rounds):
        # Each round starts one configuration later (each takes every place in turn), and each timed
        # window follows an untimed one of the same configuration: training runs one configuration
        # window after window, and a window right after another configuration's (other tensor sizes
        # for the allocator to serve) measured 8.7 % (tiny-llama 32 x 1) and 10.5 % (gpt-mini) slower.
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            window_seconds(work, configs[name], optimizer)
            times[name].append(window_seconds(work, configs[name], optimizer))
    counted = times
    # The best hand is one strategy, the fastest by its median window; each round's ratio pairs the
    # plan with that strategy's window of the same round. (Dividing by each round's fastest hand
    # instead takes the least of several noisy times, biased low: the plan's own configuration read
    # 1.04-1.06 against itself at load 2.)
    best = min(hands, key=lambda name: statistics.median(counted[name])) if hands else None
    ratios = [counted["plan"][i] / counted[best][i] for i in range(rounds)] if best is not None else []
    full = "every block full"
    vs_full = [counted["plan"][i] / counted[full][i] for i in range(rounds)] if full in hands else []
    predicted = {  # the benchmark's own profile (CPU clock), for a cell the plan loses or overruns
        name: model.evaluate(list(config_sizes(config)), config_policies(config))
        for name, config in configs.items()
    }
    return {
        "budget_bytes": budget,
        "min_micro_batch_size": floor,
        "plan_predicted_seconds": plan.predicted_seconds_per_step,  # the planner's own profile
        "profile_predicted_seconds": {name: c.seconds_per_step for name, c in predicted.items()},
        "profile_predicted_peak_bytes": {name: c.peak_bytes for name, c in predicted.items()},
        "plan": f"{plan.micro_batch_size} x {plan.steps}, {summarize_policies(plan.block_policies)}",
        "plan_seconds": statistics.median(counted["plan"]),
        "plan_peak_bytes": plan_peak,
        "plan_trial_peak_bytes": plan.measured_peak_bytes,  # the planner's trial: 2 micro-batches
        "plan_predicted_peak_bytes": plan.predicted_peak_bytes,
        "planning_seconds": planning_seconds,
        "best_hand": None if best is None else f"{best} at {hands[best][0][0][0]}",
        "best_hand_seconds": None if best is None else statistics.median(counted[best]),
        "hand_peaks": {name: peak for name, (_, peak) in hands.items()},
        "ratio": statistics.median(ratios) if ratios else None,
        "ratio_spread": [min(ratios), max(ratios)] if ratios else None,
        "vs_every_block_full": statistics.median(vs_full) if vs_full else None,
        "seconds_by_round": times,
    }


def cells(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(model, budget) in the order run: --cells "resnet50:tight,swin_t:tight,..." or every pair."""
    if not args.cells:
        return [(m, b) for m in args.models.split(",") for b in args.budgets.split(",")]
    pairs = [tuple(item.split(":")) for item in args.cells.split(",")]
    for pair in pairs:
        if len(pair) != 2 or pair[1] not in args.budgets.split(","):
            raise SystemExit(f"--cells: {':'.join(pair)!r} is not model:budget with a budget of --budgets")
    args.models = ",".join(dict.fromkeys(pair[0] for pair in pairs))
    return [(pair[0], pair[1]) for pair in pairs]


def measure(args: argparse.Namespace, done: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every model and budget in turn; ``done(report)`` after each cell (cells, loads, median so far)."""
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "environment": results.environment(),
        "load_before": os.getloadavg()[0],
        "cells": {},
    }
    if args.save and os.path.exists(args.save):  # a run cut short: its cells kept, not run again
        with open(args.save, encoding="utf-8") as file:
            report["cells"] = json.load(file)["cells"]
    prepared: dict[str, tuple[mb.Workload, Model, int, dict[str, int]]] = {}
    for name, budget_name in cells(args):
        if f"{name} {budget_name}" in report["cells"]:
            continue
        if name not in prepared:  # profiled once per model, on its first cell
            work = workload(name, args.image)
            floor = min_micro_batch(work)
            largest = min(args.batch, 16)
            sizes = (floor, max(floor, largest // 2), largest)  # profile_workload's default, from the floor
            model = Model(profile_workload(work, micro_batch_sizes=sorted(set(sizes))))
            names = args.budgets.split(",")
            prepared[name] = (work, model, floor, budgets(model, names, args.batch, floor))
        work, model, floor, found = prepared[name]
        entry = cell(work, model, args.batch, found[budget_name], args.rounds, floor)
        entry["load_after"] = os.getloadavg()[0]
        report["cells"][f"{name} {budget_name}"] = entry
        print(f"{name} {budget_name}: {entry}", file=sys.stderr, flush=True)
        report["load_after"] = entry["load_after"]
        ratios = [e["ratio"] for e in report["cells"].values() if e["ratio"] is not None]
        report["median_ratio"] = statistics.median(ratios) if ratios else None
        done(report)
    return report


def markdown(report: dict[str, Any], command: str) -> str:
    rows = []
    for key, entry in report["cells"].items():
        spread = entry["ratio_spread"]
        rows.append(
            [
                key,
                entry["plan"],
                f"{entry['plan_seconds']:.3f}",
                entry["best_hand"] or "none fits",
                f"{entry['best_hand_seconds']:.3f}" if entry["best_hand_seconds"] else "",
                f"{entry['ratio']:.3f} [{spread[0]:.3f}, {spread[1]:.3f}]" if entry["ratio"] else "",
                f"{entry['vs_every_block_full']:.3f}" if entry["vs_every_block_full"] else "",
                f"{format_bytes(entry['plan_peak_bytes'])} / {format_bytes(entry['budget_bytes'])}",
                f"{entry['planning_seconds']:.1f}",
            ]
        )
    headers = [
        "model budget",
        "plan",
        "plan s",
        "best hand",
        "hand s",
        "plan / best hand [spread]",
        "plan / every block full (torchtitan #4636: 0.945-0.951)",
        "peak / budget",
        "planning s",
    ]
    median = report["median_ratio"]
    return "\n\n".join(
        [
            f"`{command}`; load {report['load_before']:.1f} before, {report['load_after']:.1f} after "
            f"(2 shared cores); one torch thread, CPU seconds per window. {report.get('note', '')}",
            results.markdown_table(headers, rows),
            f"Median plan / best hand over cells: **{median:.3f}** (target <= 0.97)." if median else "",
            *misses(report),
        ]
    )


def misses(report: dict[str, Any]) -> list[str]:
    """For each cell over its budget or > 3 % behind the best hand: the planner's own numbers."""
    lines = []
    for key, entry in report["cells"].items():
        over = entry["plan_peak_bytes"] > entry["budget_bytes"]
        if not over and (entry["ratio"] is None or entry["ratio"] <= 1.03):
            continue
        best = entry["best_hand"].rsplit(" at ", 1)[0] if entry["best_hand"] else None
        seconds = entry["profile_predicted_seconds"]
        trial = entry["plan_trial_peak_bytes"]
        lines.append(
            f"- {key} ({'over budget' if over else 'behind the best hand'}): the planner predicted "
            f"{entry['plan_predicted_seconds']:.3f} s for its plan; the benchmark's profile predicts "
            f"{seconds['plan']:.3f} s for it"
            + (f" and {seconds[best]:.3f} s for {best}" if best else "")
            + f"; plan peak predicted {format_bytes(entry['plan_predicted_peak_bytes'])}, trial "
            f"{format_bytes(trial) if trial else 'none'}, measured {format_bytes(entry['plan_peak_bytes'])}."
        )
    return (["Cells that miss a target, with the planner's own numbers:", "\n".join(lines)]) if lines else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-mini,tiny-llama,tiny-gpt2,tiny-bert")
    parser.add_argument("--budgets", default="tight,mid,loose", help="of tight, mid, loose, mb2-3")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--image", type=int, default=32, help="torchvision models' image side (default 32)")
    parser.add_argument("--cells", help="model:budget pairs in the order to run (default: every pair)")
    parser.add_argument(
        "--save", help="write the JSON report here after every cell; cells already in it are kept, not rerun"
    )
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    order = cells(args)
    vision = [name for name, _ in order if name in VISION_MODELS]
    title = SECTION_TITLE + (VISION_SUFFIX if vision else "")
    command = results.reproducing_command(
        "planner_real", argv if argv is not None else sys.argv[1:], json_mode=args.json
    )

    def done(report: dict[str, Any]) -> None:
        if vision:
            import torchvision

            report["note"] = (
                f"torchvision {torchvision.__version__}, weights=None, {args.image} px random images, batch "
                f"{args.batch}; min_micro_batch_size 2 for BatchNorm models (plan and hands alike)."
            )
        if args.save:
            with open(args.save, "w", encoding="utf-8") as file:
                json.dump({"title": title, **report}, file, indent=2, default=str)
        if not (args.json or args.no_write):
            results.write_section(title, markdown(report, command))

    report = measure(args, done)
    return results.emit(
        title, markdown(report, command), report, json_mode=args.json, write=not args.no_write
    )


if __name__ == "__main__":
    sys.exit(main())
