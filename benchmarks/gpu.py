"""The GPU proof: budgets that hold in reserved memory, plan vs baselines, host syncs, offload, OOM.

    python benchmarks/gpu.py              # one CUDA GPU, under 8 minutes on a modern one
    python benchmarks/gpu.py --dry-run    # anywhere (CPU), tiny sizes, 2 budgets: proves it runs; CI runs it

Writes the "GPU" section of benchmarks/RESULTS.md (unless --no-write / --json). Parts:

1. Predicted vs measured peak for gpt-small and a 1B-class Llama-style model (random weights, bf16;
   transformers' LlamaConfig when installed, else a GPT of the same width and depth) at 4 budgets
   from the minimum plan to no checkpointing: allocated, reserved + the measured allowance outside
   the allocator (the budget's definition on CUDA), device used (total - free, cache held), and the
   prediction's error. Every measured point must be <= its budget.
2. At the same budgets, samples/s of the plan next to the baselines, measured one after the other in
   this run: no checkpointing with accelerate's x0.9 finder, every block checkpointed (finder too),
   torch's checkpoint_sequential over sqrt(layers) segments (GPT only: Llama layers take several
   inputs).
3. Accumulator vs a hand loop (loss / steps), seconds per window, and host syncs per window
   (torch.cuda.set_sync_debug_mode; on the CPU the count of aten._local_scalar_dense).
4. Offload vs full recompute: time, peak, and how much of the copies' serial time was hidden.
5. An out-of-memory error in the planner's trial (a ballast tensor makes the fast plan run out for
   real; simulated on the CPU), recovered by re-planning, and a full window of the plan trained
   afterwards with every sample counted. This is recovery at the planner level: a training-loop
   OOM recovery is not on this branch.

On the CPU (--dry-run) every part runs with tiny models so the script is known to work; the numbers
say nothing about GPUs, and the CUDA-only columns read n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import results
from microbatch import Accumulator, checkpoint
from microbatch.checkpointing.api import find_blocks
from microbatch.memory import MemoryTracker, format_bytes
from microbatch.memory.allocator import expandable_segments_enabled, outside_allocator_bytes, replay
from microbatch.memory.oom import free_memory, is_out_of_memory
from microbatch.models.gpt import GPT, GPTConfig
from microbatch.models.workloads import VarlenTokens, gpt_loss, gpt_optimizer
from microbatch.planner import plan
from microbatch.planner.proof.trial_run import run_trial
from microbatch.planner.search.sizes import Model, search
from microbatch.profile import preserved_state, profile_workload
from microbatch.trees.batches import move_batch
from microbatch.workload import Workload

TITLE = "GPU"
NOT_RUN = "Ready, not yet run on a GPU (no GPU lent to this task)."


@dataclass(frozen=True)
class Sizes:
    gpt: GPTConfig
    llama: dict[str, int]
    batch_gpt: int
    batch_llama: int
    windows: int  # timed windows per mechanism (after one warm-up)
    profile_max: int
    names: tuple[str, str] = ("gpt-small", "llama-1b")
    budgets: int = 4  # budgets per model, from the smallest plan to no checkpointing


FULL = Sizes(
    gpt=GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, dropout=0.0),
    llama={
        "hidden": 2048,
        "intermediate": 8192,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "seq": 1024,
    },
    batch_gpt=64,
    batch_llama=16,
    windows=2,
    profile_max=16,
)
# The dry run only proves that every part runs (CI and tests run it on loaded machines): two blocks,
# two budgets, one timed window each.
DRY = Sizes(
    gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256, dropout=0.0),
    llama={"hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "seq": 32},
    batch_gpt=8,
    batch_llama=4,
    windows=1,
    profile_max=4,
    names=("gpt-tiny (dry run)", "llama-tiny (dry run)"),
    budgets=2,
)


# ---------------------------------------------------------------------------------------- models


def gpt_small(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> Workload:
    torch.manual_seed(0)
    model = GPT(sizes.gpt).to(device=device, dtype=dtype)
    tokens = VarlenTokens(block_size=sizes.gpt.block_size, min_length=sizes.gpt.block_size, seed=1)
    return Workload(
        model=model, make_batch=tokens, loss=gpt_loss, optimizer=gpt_optimizer, name=sizes.names[0]
    )


def llama_1b(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> tuple[Workload, str]:
    shape = sizes.llama
    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        from microbatch.hf import causal_lm_workload
    except ImportError:
        config = GPTConfig(
            n_layer=shape["layers"], n_head=shape["heads"], n_embd=shape["hidden"], block_size=shape["seq"],
            vocab_size=shape["vocab"], dropout=0.0,
        )  # fmt: skip
        model = GPT(config).to(device=device, dtype=dtype)
        tokens = VarlenTokens(
            block_size=shape["seq"], min_length=shape["seq"], vocab_size=shape["vocab"], seed=2
        )
        return Workload(
            model, tokens, gpt_loss, gpt_optimizer, name="llama-1b-like (GPT blocks)"
        ), "local GPT"
    config = LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(2)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, shape["vocab"], (size, shape["seq"]), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}  # no attention_mask: no padding, no mask syncs

    workload = causal_lm_workload(model, make_batch, name=sizes.names[1], check_loss=False)
    return workload, "transformers LlamaConfig"


# ---------------------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Window:
    seconds: float  # median per timed window
    allocated_bytes: int  # peak live bytes (allocator's on CUDA, tracker's on CPU)
    reserved_bytes: int | None
    device_used_bytes: int | None
    items: int
    modelled_reserved_bytes: int  # the warm-up window's allocations replayed (microbatch.memory.allocator)


def split_sizes(batch: int, micro: int) -> list[int]:
    return [micro] * (batch // micro) + ([batch % micro] if batch % micro else [])


@contextlib.contextmanager
def applied(model: nn.Module, policies: dict[str, str], sequential: int) -> Iterator[None]:
    """The model with a checkpoint policy per block, or with checkpoint_sequential over its blocks."""
    handle = checkpoint(model, policy=policies) if any(p != "none" for p in policies.values()) else None
    blocks = getattr(model, "blocks", None)
    if sequential and isinstance(blocks, nn.ModuleList):
        model.blocks = nn.ModuleList([SequentialSegments(blocks, sequential)])
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        if sequential and isinstance(blocks, nn.ModuleList):
            model.blocks = blocks


class SequentialSegments(nn.Module):
    """torch.utils.checkpoint.checkpoint_sequential over a GPT's blocks."""

    def __init__(self, blocks: nn.ModuleList, segments: int) -> None:
        super().__init__()
        self.inner, self.segments = nn.Sequential(*blocks), segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint_sequential(self.inner, self.segments, x, use_reentrant=False)


def run_windows(
    workload: Workload, sizes: Sequence[int], policies: dict[str, str], windows: int, *, sequential: int = 0
) -> Window:
    """A warm-up window, then ``windows`` timed ones; the model is restored after.

    Peaks: CUDA's allocator statistics over all windows; on the CPU MemoryTracker over the warm-up
    window (the tracker slows every op, so the timed windows run without it). The warm-up window's
    allocations, replayed through the caching-allocator model, give the modelled reserved peak.
    """
    model, device = workload.model, workload.device
    data = [[workload.make_batch(size) for size in sizes] for _ in range(windows + 1)]
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with preserved_state(model), applied(model, policies, sequential):
        model.train()
        optimizer = workload.make_optimizer()
        accumulator = Accumulator(model, optimizer, steps=len(sizes))
        times, items, tracker = [], 0, None
        for index, window in enumerate(data):
            tracking = index == 0
            if tracking:
                tracker = MemoryTracker(device, model=model, optimizer=optimizer, record_allocations=True)
            synchronize(device)
            began = time.perf_counter()
            with tracker if tracking and tracker is not None else contextlib.nullcontext():
                for micro in accumulator.iterate(move_batch(batch, device) for batch in window):
                    loss, count = workload.loss(model, micro.batch)
                    accumulator.backward(loss, items=count)
                    if micro.is_last:
                        items = accumulator.step().items
            synchronize(device)
            times.append(time.perf_counter() - began)
        del optimizer, accumulator
    assert tracker is not None and tracker.allocation_events is not None
    modelled = replay(tracker.allocation_events, expandable_segments=expandable_segments_enabled())
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        return Window(
            statistics.median(times[1:] or times),
            int(torch.cuda.max_memory_allocated(device)),
            int(torch.cuda.max_memory_reserved(device)),
            int(total_bytes - free_bytes),
            items,
            modelled.peak_reserved_bytes,
        )
    seconds = statistics.median(times[1:] or times)
    return Window(seconds, tracker.peak_bytes, None, None, items, modelled.peak_reserved_bytes)


def finder(
    workload: Workload,
    profile: Any,
    batch: int,
    capacity_bytes: int,
    policies: dict[str, str],
    *,
    sequential: int = 0,
) -> int | None:
    """accelerate's find_executable_batch_size rule (x0.9 after each failure) against the budget."""
    micro = batch
    model = Model(profile)
    while micro >= 1:
        candidate = model.evaluate(split_sizes(batch, micro), policies)
        try:
            with applied(workload.model, {}, sequential):
                peak = run_trial(workload, candidate).peak_bytes
            if peak <= capacity_bytes:
                return micro
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error):
                raise
            free_memory(workload.device)
        micro = int(micro * 0.9)
    return None


# ---------------------------------------------------------------------------------------- parts


def budgets_of(profile: Any, batch: int, reserve: int, count: int = 4) -> list[int]:
    """``count`` budgets from just above the smallest plan to just above no checkpointing (reserve in)."""
    low = search(profile, per_rank_batch=batch, capacity_bytes=math.inf).minimum.peak_bytes * 1.03
    high = Model(profile).evaluate([batch], {}).peak_bytes * 1.05
    return [int(reserve + low + (high - low) * k / (count - 1)) for k in range(count)]


def part_budgets(
    workload: Workload, batch: int, sizes: Sizes, notes: list[str]
) -> tuple[list[list[Any]], list[list[Any]]]:
    device = workload.device
    profile = profile_workload(workload, max_micro_batch_size=min(batch, sizes.profile_max))
    reserve = outside_allocator_bytes(device)
    blocks = [name for name, _ in find_blocks(workload.model, "auto")]
    every = dict.fromkeys(blocks, "full")
    segments = max(1, round(math.sqrt(len(blocks)))) if hasattr(workload.model, "blocks") else 0
    accuracy, speed = [], []
    for budget in budgets_of(profile, batch, reserve, sizes.budgets):
        chosen = plan(workload, batch=batch, memory=budget, profile=profile)
        ran = run_windows(workload, chosen.micro_batch_sizes, chosen.policies, sizes.windows)
        measured = (ran.reserved_bytes if ran.reserved_bytes is not None else ran.allocated_bytes) + reserve
        error = (chosen.predicted_peak_bytes - measured) / measured
        accuracy.append([
            workload.name, format_bytes(budget), f"{chosen.micro_batch_size} x {chosen.steps}",
            summarize(chosen.policies), format_bytes(chosen.predicted_peak_bytes),
            format_bytes(ran.allocated_bytes),
            format_bytes(ran.modelled_reserved_bytes + reserve),
            format_bytes(measured) if ran.reserved_bytes is not None else "n/a",
            format_bytes(ran.device_used_bytes) if ran.device_used_bytes is not None else "n/a",
            f"{error:+.1%}", "yes" if measured <= budget else "**NO**",
        ])  # fmt: skip
        row = [workload.name, format_bytes(budget), f"{batch / ran.seconds:.1f}"]
        for name, policies, sequential in (
            ("none", {}, 0),
            ("every", every, 0),
            ("sequential", {}, segments),
        ):
            if name == "sequential" and not segments:
                row.append("n/a")
                continue
            micro = finder(workload, profile, batch, budget - reserve, policies, sequential=sequential)
            if micro is None:
                row.append("does not fit")
                continue
            other = run_windows(
                workload, split_sizes(batch, micro), policies, sizes.windows, sequential=sequential
            )
            row.append(f"{batch / other.seconds:.1f} (micro {micro})")
        speed.append(row)
    notes.append(f"{workload.name}: allowance outside the allocator {format_bytes(reserve)}")
    return accuracy, speed


def summarize(policies: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for policy in policies.values():
        counts[policy] = counts.get(policy, 0) + 1
    used = {k: v for k, v in counts.items() if k != "none"}
    return ", ".join(f"{v} {k}" for k, v in sorted(used.items())) or "none"


class ScalarReads(TorchDispatchMode):
    """The CPU's stand-in for a sync count: reads of one tensor value (``.item()``, ``float(t)``),
    except the optimizer's own reads of its step counters, which live on the host on a GPU too."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not any(
            f"{os.sep}optim{os.sep}" in frame.filename for frame in traceback.extract_stack()
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs(device: torch.device) -> Iterator[list[int]]:
    """Counts host syncs inside the block: CUDA's sync debug warnings, or scalar reads on the CPU."""
    found = [0]
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found[0] = sum("synchroniz" in str(w.message) for w in caught)
    else:
        with ScalarReads() as reads:
            yield found
        found[0] = reads.count


def part_overhead(workload: Workload, micro: int, steps: int, rounds: int) -> list[list[Any]]:
    model, device = workload.model, workload.device
    data = [move_batch(workload.make_batch(micro), device) for _ in range(steps)]

    def accumulator_window(accumulator: Accumulator) -> None:
        for item in accumulator.iterate(data):
            loss, count = workload.loss(model, item.batch)
            accumulator.backward(loss, items=count)
            if item.is_last:
                accumulator.step()

    def hand_window(optimizer: torch.optim.Optimizer) -> None:
        for batch in data:
            loss, _ = workload.loss(model, batch)
            (loss / steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows = []
    with preserved_state(model):
        optimizer = workload.make_optimizer()
        accumulator = Accumulator(model, optimizer, steps=steps)
        loops: dict[str, Callable[[], None]] = {
            "hand loop (loss / steps)": lambda: hand_window(optimizer),
            "Accumulator": lambda: accumulator_window(accumulator),
        }
        times: dict[str, list[float]] = {name: [] for name in loops}
        syncs: dict[str, int] = {}
        for _ in range(rounds + 1):  # interleaved; the first round warms up
            for name, loop in loops.items():
                synchronize(device)
                began = time.perf_counter()
                loop()
                synchronize(device)
                times[name].append(time.perf_counter() - began)
        for name, loop in loops.items():
            with host_syncs(device) as found:
                loop()
            syncs[name] = found[0]
    hand = statistics.median(times["hand loop (loss / steps)"][1:])
    for name in loops:
        seconds = statistics.median(times[name][1:])
        rows.append(
            [
                workload.name,
                name,
                f"{micro} x {steps}",
                f"{seconds * 1000:.1f}",
                f"{seconds / hand - 1:+.1%}",
                syncs[name],
            ]
        )
    return rows


def part_offload(workload: Workload, micro: int, steps: int, windows: int) -> list[list[Any]]:
    device = workload.device
    blocks = [name for name, _ in find_blocks(workload.model, "auto")]
    sizes = [micro] * steps
    rows, runs = [], {}
    for policy in ("none", "full", "offload"):
        runs[policy] = run_windows(workload, sizes, dict.fromkeys(blocks, policy), windows)
        ran = runs[policy]
        peak = ran.reserved_bytes if ran.reserved_bytes is not None else ran.allocated_bytes
        rows.append(
            [workload.name, policy, f"{micro} x {steps}", f"{ran.seconds * 1000:.1f}", format_bytes(peak)]
        )
    if device.type != "cuda":
        rows.append([workload.name, "copies hidden", "", "n/a on the CPU (host tensors stay in place)", ""])
        return rows
    # What the copies would cost in series: each block input to pinned host memory and back.
    sample = move_batch(workload.make_batch(micro), device)
    width = workload.model.config.n_embd if hasattr(workload.model, "config") else 1
    nbytes = (
        len(blocks) * sample["input_ids"].numel() * width * next(workload.model.parameters()).element_size()
    )
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(steps):
        host.copy_(device_buffer, non_blocking=True)
        device_buffer.copy_(host, non_blocking=True)
    synchronize(device)
    serial = time.perf_counter() - began
    extra = runs["offload"].seconds - runs["full"].seconds
    hidden = min(1.0, max(0.0, 1 - extra / serial)) if serial > 0 else 0.0
    rows.append(
        [workload.name, "copies hidden", "", f"{hidden:.0%} of {serial * 1000:.1f} ms serial copies", ""]
    )
    return rows


class OutOfMemoryAbove:
    """The CPU's stand-in for a real OOM: micro-batches above ``largest`` raise torch's error."""

    def __init__(self, loss: Any, largest: int) -> None:
        self.loss, self.largest, self.raised = loss, largest, 0

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        if batch["input_ids"].shape[0] > self.largest:
            self.raised += 1
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return self.loss(model, batch)


def part_oom(workload: Workload, batch: int, sizes: Sizes) -> list[list[Any]]:
    device = workload.device
    profile = profile_workload(workload, max_micro_batch_size=min(batch, sizes.profile_max))
    reserve = outside_allocator_bytes(device)
    high = Model(profile).evaluate([batch], {}).peak_bytes
    low = search(profile, per_rank_batch=batch, capacity_bytes=math.inf).minimum.peak_bytes
    budget = int(reserve + high * 1.1)  # every plan fits the budget; the device will not hold the fast ones
    ballast = None
    if device.type == "cuda":
        free_memory(device)
        free_bytes, _ = torch.cuda.mem_get_info(device)
        room = int((low + high) / 2) - int(torch.cuda.memory_allocated(device))
        ballast = torch.empty(max(0, free_bytes - room), dtype=torch.uint8, device=device)
        how = "real (a ballast tensor leaves room for plans below the midpoint)"
    else:
        workload = replace(workload, loss=OutOfMemoryAbove(workload.loss, largest=max(1, batch // 4)))
        how = "simulated (torch.OutOfMemoryError above a quarter of the batch)"
    try:
        chosen = plan(workload, batch=batch, memory=budget, profile=profile)
        ran = run_windows(workload, chosen.micro_batch_sizes, chosen.policies, 0)
    finally:
        del ballast
        free_memory(device)
    expected = batch * sizes.gpt.block_size  # every token of every sequence is counted
    recovered = [note for note in chosen.notes if "out of memory" in note]
    return [[
        workload.name, how, len(recovered), f"{chosen.micro_batch_size} x {chosen.steps}", chosen.trials,
        f"{ran.items} of {expected}", "yes" if recovered and ran.items == expected else "**NO**",
    ]]  # fmt: skip


# ---------------------------------------------------------------------------------------- report


def environment(device: torch.device) -> str:
    if device.type != "cuda":
        return f"CPU dry run: {results.environment_line()}"
    driver = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    name = torch.cuda.get_device_name(device)
    return f"{name}, driver {driver}, CUDA {torch.version.cuda}, {results.environment_line()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU: proves the script runs"
    )
    parser.add_argument(
        "--quick", action="store_true", help="the same as --dry-run (microbatch bench --quick)"
    )
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or args.quick
    if not args.dry_run and not torch.cuda.is_available():
        return leave_section_alone(json_mode=args.json)
    sizes = DRY if args.dry_run else FULL
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    began = time.perf_counter()
    env = environment(device)
    notes: list[str] = []
    gpt = gpt_small(sizes, device, dtype)
    accuracy, speed = part_budgets(gpt, sizes.batch_gpt, sizes, notes)
    llama, built_from = llama_1b(sizes, device, dtype)
    more_accuracy, more_speed = part_budgets(llama, sizes.batch_llama, sizes, notes)
    del llama
    free_memory(device)
    notes.append(f"the Llama-style model is built from {built_from}")
    micro = max(1, sizes.batch_gpt // 8)
    overhead = part_overhead(gpt, micro, 4, 3 if args.dry_run else 5)
    offload = part_offload(gpt, micro, 2, sizes.windows)
    oom = part_oom(gpt, sizes.batch_gpt, sizes)
    seconds = time.perf_counter() - began
    markdown = render(
        env, accuracy + more_accuracy, speed + more_speed, overhead, offload, oom, notes, args, seconds
    )
    report = {"dry_run": args.dry_run, "seconds": seconds, "environment": env}
    return results.emit(TITLE, markdown, report, json_mode=args.json, write=not args.no_write)


def leave_section_alone(*, json_mode: bool) -> int:
    """Without CUDA (and without --dry-run) nothing is measured and the GPU section stays as it is:
    a CPU machine running every suite (microbatch bench) must not overwrite a GPU's results."""
    print(
        "no CUDA device: the GPU section is left as it is (use --dry-run to check the script)",
        file=sys.stderr,
    )
    text = results.RESULTS_PATH.read_text(encoding="utf-8") if results.RESULTS_PATH.exists() else ""
    _, sections = results._split_sections(text)
    current = next(("\n".join(lines[1:]) for title, lines in sections if title == TITLE), NOT_RUN)
    if json_mode:
        return results.emit(TITLE, current, {"measured": False}, json_mode=True, write=False)
    return 0


def render(
    env: str,
    accuracy: list[list[Any]],
    speed: list[list[Any]],
    overhead: list[list[Any]],
    offload: list[list[Any]],
    oom: list[list[Any]],
    notes: list[str],
    args: argparse.Namespace,
    seconds: float,
) -> str:
    command = results.reproducing_command(
        "gpu", sys.argv[1:] if args is not None else [], json_mode=args.json
    )
    lead = (
        f"{NOT_RUN} Below: the CPU dry run (tiny models, float32, the machine shared with other jobs), "
        "which proves the script runs end to end; its numbers say nothing about GPUs. On a GPU run "
        "`python benchmarks/gpu.py`."
        if args.dry_run
        else "Measured on one GPU; a budget is peak reserved bytes + the allowance outside the allocator."
    )
    table = results.markdown_table
    parts = [
        lead,
        f"Environment: {env}. Whole run {seconds:.0f} s. Reproduce: `{command}`",
        "### Predicted vs measured peak",
        table(
            [
                "model",
                "budget",
                "plan",
                "checkpointed",
                "predicted",
                "allocated",
                "modelled reserved + outside",
                "reserved + outside",
                "device used",
                "error",
                "fits",
            ],
            accuracy,
        ),
        "### Plan vs baselines, samples/s (side by side, one run)",
        table(
            [
                "model",
                "budget",
                "plan",
                "no checkpointing, x0.9 finder",
                "every block, x0.9 finder",
                "checkpoint_sequential",
            ],
            speed,
        ),
        "### Accumulator overhead and host syncs per window",
        table(
            ["model", "loop", "window", "ms per window", "vs hand loop", "host syncs per window"], overhead
        ),
        "### Offload vs full recompute",
        table(["model", "policy", "window", "ms per window", "peak"], offload),
        "### Out of memory in the trial, recovered (planner level)",
        table(["model", "OOM", "OOM trials", "plan", "trials", "items in the next window", "recovered"], oom),
        "Notes: " + "; ".join(notes) + ".",
    ]
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
