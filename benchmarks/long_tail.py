"""Long-tailed SFT-like data through the real HF Trainer: one epoch four ways at one memory budget.

Data: 128 samples, 112 chat turns of 12-24 tokens and 16 documents of 180-200 tokens stored last (a
set concatenated from two sources), as in issue 33. The shape (most samples short, a tail ~10x longer)
is that of chat-SFT mixes; the figures are chosen, not fitted to a published distribution (said
honestly: from memory of ShareGPT-style sets, where most turns are tens of tokens and documents
hundreds). Model: tiny Llama (3 layers x 64, float32, CPU). Budget: 1.25x the measured peak of one
training step on a micro-batch of the two longest samples.

    (a) rows:      fit_trainer(batch=16, memory=budget): planned on the longest samples (hf/lengths.py)
    (b) tokens:    fit_trainer(..., max_tokens="auto"): each window cut by padded tokens
    (c) auto_find: HF auto_find_batch_size from 16 x 1; out-of-memory emulated (a RuntimeError "CUDA out
                   of memory" when a window's tracked peak passes the budget, which accelerate catches)
    (d) padded:    the plan of (a), every row padded to the dataset's longest sample

Each window's peak: fit_trainer's own record (hf/trainer_peaks.py) with every window measured
(``every=1``), attached the same way to all four variants so each pays the same tracking cost: a
MemoryTracker from the window's micro-batches drawn to its optimizer step's end, the parameters,
gradients, optimizer state and the window's inputs counted from the start. (c) also has the
out-of-memory emulation's own tracker, per window, whose peaks (c)'s row shows (it opens at
on_step_begin, after the window's inputs are drawn, without the optimizer: its state counts only
once the step touches it). tokens/s comes from a second epoch of (a), (b), (d) with no window
measured (a tracker's cost per op would hide what the padding costs); (c) is timed with its tracker.

    python benchmarks/long_tail.py            # prints the table (markdown) and JSON
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

import microbatch as mb
from microbatch import hf
from microbatch.hf.trainer_peaks import record_window_peaks
from microbatch.memory import format_bytes

sys.path.insert(0, "tests")
from test_hf_long_tail import LongTail, _trainer, _two_longest_step_peak, collate

BATCH = 16


class WindowPeaks(transformers.TrainerCallback):
    """Each optimizer step's peak, by a tracker opened for it; optionally 'out of memory' above a budget."""

    def __init__(self, model: torch.nn.Module, budget: int, *, raise_over: bool = False) -> None:
        self.model, self.budget, self.raise_over = model, budget, raise_over
        self.peaks: list[int] = []
        self.tracker: mb.MemoryTracker | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.tracker = mb.MemoryTracker(model=self.model).__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.tracker is not None
        self.tracker.__exit__(None, None, None)
        self.peaks.append(self.tracker.peak_bytes)
        if self.raise_over and self.tracker.peak_bytes > self.budget:
            raise RuntimeError("CUDA out of memory. (emulated: the window passed the budget)")


def _tokens_counter(model: torch.nn.Module) -> dict[str, int]:
    seen = {"real": 0, "padded": 0, "rows": 0}

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        seen["real"] += int(kwargs["attention_mask"].sum())
        seen["padded"] += int(kwargs["input_ids"].numel())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _untracked_seconds(make: Callable[[], Any], budget: int) -> float:
    """One epoch with fit_trainer's record removed (the Trainer's own methods back)."""
    trainer = make()
    record_window_peaks(trainer, budget_bytes=budget).remove()
    began = time.perf_counter()
    trainer.train()
    return time.perf_counter() - began


def _run(name: str, make: Callable[[], Any], budget: int, *, raise_over: bool = False) -> dict[str, Any]:
    # tokens/s from an epoch without trackers (a tracker's cost per op would hide the padding's);
    # auto_find's needs its tracker to emulate out of memory, so it is timed with it
    untracked = None if raise_over else _untracked_seconds(make, budget)
    trainer = make()
    record = record_window_peaks(trainer, budget_bytes=budget)  # fit_trainer's, or a new one
    record.peak.every = 1  # every window measured, in every variant
    raised = WindowPeaks(trainer.model, budget, raise_over=True) if raise_over else None
    if raised is not None:
        trainer.add_callback(raised)
    seen = _tokens_counter(trainer.model)
    began = time.perf_counter()
    trainer.train()
    seconds = untracked if untracked is not None else time.perf_counter() - began
    peaks = raised.peaks if raised is not None else [r["peak_bytes"] for r in record.records]
    args = trainer.args
    micro = trainer._train_batch_size
    return {
        "variant": name,
        # one epoch's real tokens over the whole run's time (auto_find's restarts included)
        "tokens_per_s": sum(len(r) for r in trainer.train_dataset.rows) / seconds,
        "padding_share": 1 - seen["real"] / seen["padded"],
        # auto_find: every attempt's window by the emulation's tracker (it restarts the epoch on out
        # of memory, and a window that raised leaves no record in fit_trainer's)
        "windows": len(peaks),
        "worst_window_bytes": max(peaks),
        "windows_over": sum(p > budget for p in peaks),
        "micro_batch": micro,
        "steps": args.gradient_accumulation_steps,
        "effective_batch": BATCH if name != "auto_find" else micro * args.gradient_accumulation_steps,
        "seconds": seconds,
    }


def _padded_to_longest(longest: int) -> Any:
    def pad_all(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = collate(examples)
        extra = longest - batch["input_ids"].shape[1]
        pads = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {k: torch.nn.functional.pad(v, (0, extra), value=pads[k]) for k, v in batch.items()}

    return pad_all


def main() -> None:
    torch.set_num_threads(1)
    dataset = LongTail()
    out = tempfile.mkdtemp()
    budget = int(1.25 * _two_longest_step_peak(_trainer(out, dataset).model, dataset))
    plan_rows = hf.fit_trainer(_trainer(out, dataset), batch=BATCH, memory=budget)

    def rows_plan() -> Any:
        trainer = _trainer(out, dataset)
        hf.fit_trainer(trainer, batch=BATCH, memory=budget)
        return trainer

    def tokens_plan() -> Any:
        trainer = _trainer(out, dataset)
        hf.fit_trainer(trainer, batch=BATCH, memory=budget, max_tokens="auto")
        return trainer

    def auto_find() -> Any:
        trainer = _trainer(out, dataset)
        trainer.args.auto_find_batch_size, trainer.args.per_device_train_batch_size = True, BATCH
        trainer._train_batch_size = BATCH
        return trainer

    def padded() -> Any:
        trainer = _trainer(out, dataset)
        trainer.data_collator = _padded_to_longest(max(len(r) for r in dataset.rows))
        trainer.args.per_device_train_batch_size = plan_rows.micro_batch_size
        trainer.args.gradient_accumulation_steps = plan_rows.steps
        trainer._train_batch_size = plan_rows.micro_batch_size
        return trainer

    rows = [
        _run("rows (fit_trainer)", rows_plan, budget),
        _run("tokens (max_tokens=auto)", tokens_plan, budget),
        _run("auto_find", auto_find, budget, raise_over=True),
        _run("padded to longest", padded, budget),
    ]
    print(f"budget {format_bytes(budget)}; plan {plan_rows.micro_batch_size} x {plan_rows.steps}")
    print("| variant | micro x steps | effective batch | tokens/s | padding | worst window | over |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['micro_batch']} x {r['steps']} | {r['effective_batch']} | "
            f"{r['tokens_per_s']:.0f} | {r['padding_share']:.0%} | {format_bytes(r['worst_window_bytes'])} | "
            f"{r['windows_over']}/{r['windows']} |"
        )
    print(json.dumps({"budget_bytes": budget, "rows": rows}))


if __name__ == "__main__":
    main()
