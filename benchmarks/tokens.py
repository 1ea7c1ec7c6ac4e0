"""Token-budget micro-batches vs fixed-row micro-batches at the same memory budget.

A window of B variable-length samples (the recipe's batch) is trained as one optimizer step two ways:

    rows:    micro-batches of R rows in the window's order, each padded to its own longest row
             (dynamic padding, as transformers' collators do).
    tokens:  micro-batches of split_by_tokens(lengths, max_tokens).

The budget is the measured peak (MemoryTracker: parameters, gradients, AdamW state, activations)
of a window of ``--rows`` rows of L_max tokens per micro-batch, run twice (the second run has
AdamW's state). ``mb.plan`` for that budget, on a Workload with ``max_length = L_max`` (batches of
full-length rows, the worst case; no checkpointing), gives both variants' settings: R, its
micro-batch size (R rows of the longest possible sample must fit), and max_tokens = R x L_max.
Each variant's peak is the largest over its windows, each measured the same way (run twice).
(Tracking many different windows in a row, MemoryTracker's peak creeps up by ~40 KB per earlier
window of other shapes, 0.15 % here; not traced, so windows are measured alike.)

Reported per distribution: real (non-padding) tokens per second (median over repetitions), the
padding fraction, each variant's peak against the budget, and the relative difference of the
window gradient (float64 copy of the model, same window both ways).

Two length distributions: the built-in corpus (chunks of the stdlib's Python files, lengths uniform
in [L_max / 4, L_max], cut at a file's end) and a synthetic chat-like one (log-normal, the 5th to
95th percentile spanning 10x, clipped to [8, L_max]).

Timing: the two variants' repetitions are interleaved, alternating which runs first, so load from
other processes on the machine hits both alike; CPU time per window is reported beside wall time.

    python benchmarks/tokens.py                  # writes the RESULTS.md section
    python benchmarks/tokens.py --quick --no-write
    microbatch bench tokens
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import microbatch as mb
from microbatch.accumulate.tokens import padded_tokens
from microbatch.models.corpus import IGNORE_INDEX, PAD_TOKEN, ByteBatches, load_corpus
from microbatch.models.gpt import GPT, GPTConfig
from microbatch.models.workloads import gpt_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results

SECTION_TITLE = "Token-budget micro-batches"
TARGET_SPEEDUP = 1.3
Sample = tuple[torch.Tensor, torch.Tensor]


def corpus_windows(count: int, size: int, max_length: int, seed: int) -> list[list[Sample]]:
    """Windows of stdlib-corpus chunks (the built-in workload's data), each cut to its real tokens."""
    batches = ByteBatches(load_corpus(max_bytes=1_000_000).train, block_size=max_length, seed=seed)
    windows = []
    for _ in range(count):
        batch = batches(size)
        lengths = (batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
        windows.append([(batch["input_ids"][r, :n], batch["labels"][r, :n]) for r, n in enumerate(lengths)])
    return windows


def chat_windows(count: int, size: int, max_length: int, seed: int) -> list[list[Sample]]:
    """Log-normal lengths: the 5th..95th percentiles are 10x apart (sigma = ln 10 / (2 x 1.645))."""
    generator = torch.Generator().manual_seed(seed)
    sigma = math.log(10.0) / (2 * 1.645)
    median = max_length / 6
    windows = []
    for _ in range(count):
        normal = torch.randn(size, generator=generator, dtype=torch.float64)
        lengths = (median * torch.exp(sigma * normal)).round().clamp(8, max_length).long().tolist()
        window = []
        for n in lengths:
            tokens = torch.randint(0, 256, (n + 1,), generator=generator)
            window.append((tokens[:-1], tokens[1:]))
        windows.append(window)
    return windows


def pad(samples: list[Sample]) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), PAD_TOKEN, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, targets) in enumerate(samples):
        input_ids[row, : len(ids)], labels[row, : len(ids)] = ids, targets
    return {"input_ids": input_ids, "labels": labels}


def row_micro_batches(window: list[Sample], rows: int) -> list[dict[str, torch.Tensor]]:
    return [pad(window[i : i + rows]) for i in range(0, len(window), rows)]


def token_micro_batches(window: list[Sample], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    groups = mb.split_by_tokens([len(ids) for ids, _ in window], max_tokens)
    return [pad([window[i] for i in group]) for group in groups]


class WindowSteps:
    """A steps schedule that is the micro-batch count of the window about to be trained."""

    def __init__(self) -> None:
        self.count = 1

    def __call__(self, window: int) -> int:
        return self.count


def train_window(
    acc: mb.Accumulator, micro_batches: Sequence[dict[str, torch.Tensor]], schedule: WindowSteps | None = None
) -> None:
    model = acc.model
    if schedule is not None:
        schedule.count = len(micro_batches)
    for micro in acc.iterate(micro_batches):
        loss, items = gpt_loss(model, micro.batch)
        acc.backward(loss, items=items)
        if micro.is_last:
            acc.step()


def accumulator(model: nn.Module) -> tuple[mb.Accumulator, WindowSteps]:
    schedule = WindowSteps()
    return mb.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-4), steps=schedule), schedule


def split_windows(windows: list[list[Sample]], rows: int, max_tokens: int) -> dict[str, list[list[Any]]]:
    return {
        "rows": [row_micro_batches(window, rows) for window in windows],
        "tokens": [token_micro_batches(window, max_tokens) for window in windows],
    }


def time_variants(
    model: nn.Module, split: dict[str, list[list[Any]]], real_tokens: list[int], repeats: int
) -> dict[str, dict[str, float]]:
    """Median real tokens per second (wall and CPU) of each variant; repetitions interleaved."""
    accs = {name: accumulator(copy.deepcopy(model)) for name in split}
    for name, windows in split.items():  # warm-up: one window each
        acc, schedule = accs[name]
        train_window(acc, windows[0], schedule)
    rates: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in split}
    names = list(split)
    for repeat in range(repeats):
        w = repeat % len(real_tokens)
        order = names if repeat % 2 == 0 else names[::-1]  # alternate which variant runs first
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            acc, schedule = accs[name]
            train_window(acc, split[name][w], schedule)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rates[name]["wall"].append(real_tokens[w] / wall)
            rates[name]["cpu"].append(real_tokens[w] / cpu)
    return {
        name: {clock: statistics.median(values) for clock, values in by_clock.items()}
        for name, by_clock in rates.items()
    }


class LazyCopies(Sequence[dict[str, torch.Tensor]]):
    """A window's micro-batches, each copied when it is read."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: Any) -> Any:
        return {key: value.clone() for key, value in self.batches[index].items()}


def measured_peak(model: nn.Module, windows: list[list[Any]]) -> int:
    """MemoryTracker's peak over training these windows (model, gradients, AdamW state, activations)."""
    model = copy.deepcopy(model)
    acc, schedule = accumulator(model)
    with mb.MemoryTracker("cpu", model=model, optimizer=acc.optimizer) as tracker:
        for window in windows:
            # Fresh copies made as each micro-batch is handed out, as a data loader would: the list
            # keeps every window's batches alive, and the tracker would count them all.
            train_window(acc, LazyCopies(window), schedule)
    return tracker.peak_bytes


def worst_case_budget(model: nn.Module, rows: int, max_length: int, window: int) -> int:
    """The budget a fixed-row plan needs: the peak over two windows of R x L_max micro-batches
    (two, so AdamW's state exists at the second window's peak)."""
    generator = torch.Generator().manual_seed(7)
    samples = [
        (tokens[:-1], tokens[1:])
        for tokens in torch.randint(0, 256, (window, max_length + 1), generator=generator)
    ]
    return measured_peak(model, [row_micro_batches(samples, rows)] * 2)


def gradient_difference(model: nn.Module, window: list[Sample], rows: int, max_tokens: int) -> float:
    """max |g_rows - g_tokens| / max |g_tokens| for one window, in float64."""
    grads = []
    for micro_batches in (row_micro_batches(window, rows), token_micro_batches(window, max_tokens)):
        clone = copy.deepcopy(model).double()
        captured: dict[str, torch.Tensor] = {}
        acc = mb.Accumulator(clone, torch.optim.SGD(clone.parameters(), lr=0.0), steps=len(micro_batches))
        acc.optimizer.register_step_pre_hook(
            lambda *_, c=clone, out=captured: out.update({n: p.grad.clone() for n, p in c.named_parameters()})
        )
        train_window(acc, micro_batches)
        grads.append(captured)
    rows_grads, token_grads = grads
    numerator = max(float((rows_grads[n] - token_grads[n]).abs().max()) for n in token_grads)
    return numerator / max(float(g.abs().max()) for g in token_grads.values())


def run_distribution(
    model: nn.Module, windows: list[list[Sample]], *, rows: int, max_tokens: int, budget: int, repeats: int
) -> dict[str, Any]:
    split = split_windows(windows, rows, max_tokens)
    real = [sum(len(ids) for ids, _ in window) for window in windows]
    rates = time_variants(model, split, real, repeats)
    report: dict[str, Any] = {"windows": len(windows), "window_size": len(windows[0]), "variants": {}}
    for name, micro in split.items():
        padded = sum(batch["input_ids"].numel() for window in micro for batch in window)
        # Each window after a warm-up run of itself (so AdamW's state exists), as the budget is measured.
        peak = max(measured_peak(model, [window, window]) for window in micro)
        report["variants"][name] = {
            "micro_batches_per_window": statistics.mean(len(window) for window in micro),
            "padding_fraction": 1.0 - sum(real) / padded,
            "largest_micro_batch_tokens": max(batch["input_ids"].numel() for w in micro for batch in w),
            "real_tokens_per_s_wall": rates[name]["wall"],
            "real_tokens_per_s_cpu": rates[name]["cpu"],
            "peak_bytes": peak,
            "peak_within_budget": peak <= budget,
        }
    lengths = [len(ids) for ids, _ in windows[0]]
    fewest = mb.split_by_tokens(lengths, max_tokens)
    report["token_split_padded_tokens_window0"] = padded_tokens(lengths, fewest)
    report["speedup_wall"] = rates["tokens"]["wall"] / rates["rows"]["wall"]
    report["speedup_cpu"] = rates["tokens"]["cpu"] / rates["rows"]["cpu"]
    report["gradient_relative_difference_float64"] = gradient_difference(model, windows[0], rows, max_tokens)
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer windows (smoke run)")
    parser.add_argument("--max-length", type=int, default=256, help="longest sample, tokens (L_max)")
    parser.add_argument(
        "--rows", type=int, default=8, help="the budget: the measured peak of micro-batches of ROWS x L_max"
    )
    parser.add_argument("--window", type=int, default=64, help="samples per window (the recipe's batch)")
    parser.add_argument("--windows", type=int, default=6, help="windows per distribution")
    parser.add_argument("--repeats", type=int, default=12, help="timed windows per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.max_length, args.window, args.windows, args.repeats = 128, 32, 3, 4
    return args


def planned(model: nn.Module, budget: int, window: int, max_length: int) -> mb.Plan:
    """mb.plan for the budget, on worst-case batches (rows of max_length), no checkpointing."""
    generator = torch.Generator().manual_seed(11)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, 256, (size, max_length + 1), generator=generator)
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    workload = mb.Workload(
        model=copy.deepcopy(model),
        make_batch=make_batch,
        loss=gpt_loss,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
        name="benchmark GPT",
        max_length=max_length,
    )
    return mb.plan(workload, batch=window, memory=budget, policies=["none"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=args.max_length, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(config)
    budget = worst_case_budget(model, args.rows, args.max_length, args.window)
    chosen = planned(model, budget, args.window, args.max_length)
    rows, max_tokens = chosen.micro_batch_size, chosen.max_tokens
    assert max_tokens is not None  # the workload declares max_length
    sizes = (args.windows, args.window, args.max_length)
    distributions = {
        "stdlib corpus": corpus_windows(*sizes, seed=0),
        "chat-like (log-normal, 10x)": chat_windows(*sizes, seed=0),
    }
    options = {"rows": rows, "max_tokens": max_tokens, "budget": budget, "repeats": args.repeats}
    info = results.environment()
    return {
        "benchmark": "tokens",
        "config": {
            "model": f"GPT(n_layer=2, n_head=4, n_embd=128, block_size={args.max_length})",
            "budget_rows": args.rows,
            "rows": rows,
            "max_tokens": max_tokens,
            "plan": str(chosen).splitlines()[0],
            "window": args.window,
            "windows": args.windows,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        "machine": {
            **info,
            "load_average_1min_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "budget_bytes": budget,
        "target_speedup": TARGET_SPEEDUP,
        "distributions": {name: run_distribution(model, w, **options) for name, w in distributions.items()},
    }


def markdown(report: dict[str, Any], command: str) -> str:
    config = report["config"]
    rows = []
    for name, dist in report["distributions"].items():
        for variant, v in dist["variants"].items():
            label = f"{config['rows']} rows" if variant == "rows" else f"max_tokens {config['max_tokens']}"
            speed = (
                f"{dist['speedup_wall']:.2f}x (CPU {dist['speedup_cpu']:.2f}x)" if variant == "tokens" else ""
            )
            rows.append(
                [
                    name,
                    label,
                    f"{v['micro_batches_per_window']:.1f}",
                    f"{100 * v['padding_fraction']:.1f} %",
                    f"{v['real_tokens_per_s_wall']:,.0f}",
                    f"{v['real_tokens_per_s_cpu']:,.0f}",
                    f"{mb.format_bytes(v['peak_bytes'])} / {mb.format_bytes(report['budget_bytes'])}",
                    speed,
                    f"{dist['gradient_relative_difference_float64']:.1e}" if variant == "tokens" else "",
                ]
            )
    headers = [
        "lengths",
        "micro-batches",
        "per window",
        "padding",
        "real tokens/s (wall)",
        "real tokens/s (CPU)",
        "peak / budget",
        "tokens vs rows",
        "grad diff (f64)",
    ]
    chat = next(d for n, d in report["distributions"].items() if n.startswith("chat"))
    met = chat["speedup_wall"] >= TARGET_SPEEDUP and all(
        v["peak_within_budget"] for v in chat["variants"].values()
    )
    return "\n".join(
        [
            f"{config['model']}, AdamW, windows of {config['window']} samples, "
            f"{config['threads']} thread(s); budget = measured peak of windows of "
            f"{config['budget_rows']}-row micro-batches of the longest length. mb.plan for that budget "
            f"(no checkpointing): {config['rows']} rows per micro-batch, "
            f"max_tokens {config['max_tokens']}. Rows variant: "
            "the plan's rows, dynamic padding to each micro-batch's longest row.",
            "",
            results.markdown_table(headers, rows),
            "",
            f"Target >= {TARGET_SPEEDUP}x real tokens/s on the chat-like lengths with peak <= budget: "
            f"{'met' if met else 'NOT met'}. Medians over {config['repeats']} windows per variant, the two "
            "variants' repetitions interleaved (alternating first) because the machine was shared with other "
            f"jobs (1-min load average at the end: {report['machine']['load_average_1min_end']:.1f}); "
            "grad diff = max |g_rows - g_tokens| / max |g| on one window in float64.",
            "",
            f"Measured on {results.environment_line(report['machine'])}. Reproduce: `{command}`",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    report = run(args)
    command = results.reproducing_command("tokens", argv, json_mode=args.json)
    return results.emit(
        SECTION_TITLE, markdown(report, command), report, json_mode=args.json, write=not args.no_write
    )


if __name__ == "__main__":
    raise SystemExit(main())
