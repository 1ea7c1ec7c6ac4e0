"""Peers: microbatch against Accelerate, Lightning and hand-written loops on the same work.

    pip install -e '.[bench]'          # accelerate, lightning, transformers
    python benchmarks/peers.py [--quick] [--json] [--parts correctness speed budget]

Every tool runs for real, in this one process, side by side:

1. Correctness. microbatch, Accelerate, Lightning, the HF Trainer (with a model that takes the
   window's item count, and with one that returns a mean) and a nanoGPT-style loop: the gradient
   each hands its optimizer (SGD with lr=0, so parameters never move) against the full batch's
   gradient on the same samples, in float64:
   error = max |g - g_full| / max |g_full| over all parameters. Cases: (1) equal-size
   micro-batches, sample-mean loss; (2) token-mean loss on variable-length sequences; (3) a partial
   last window (7 micro-batches, 4 per window: the last window has 3); (4) clipping to a quarter
   of the full batch's gradient norm. Dividing each micro-batch's mean by a fixed step count is
   exact in (1) and (4) only: in (2) a micro-batch with few tokens weighs as much as one with
   many, and in (3) the short window's gradient comes out scaled by 3/4.
2. Speed. Seconds per optimizer step of transformers' GPT-2 (small config, random init, nothing
   downloaded) on variable-length byte sequences: same micro-batches, AdamW, clipping at 1.0.
   Each tool's time is divided by the hand-written loop's from the same round; rounds interleave
   the tools, so machine load hits all of them alike; the ratio reported is the median over rounds.
3. A smaller memory budget. The recipe (micro-batch x steps) no longer fits, and each tool's own
   mechanism finds what does: Accelerate's find_executable_batch_size, Lightning's batch-size
   finder, transformers' gradient checkpointing of every layer, microbatch's plan. The budget is
   bytes of peak live tensor memory (microbatch.memory.MemoryTracker). A micro-batch size "runs out
   of memory" when a steady-state window of the plain loop at that size peaks above the budget under
   the tracker: the model's forward then raises the CPU allocator's own out-of-memory error, so each
   tool's OOM handling reacts as it would on a full device. microbatch's planner measures for itself.

With --json it prints the report (with its markdown section) for ``microbatch bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import itertools
import json
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import microbatch as mb
import results
from microbatch.batching import micro_batch_sizes, split_batch
from microbatch.errors import MicrobatchError
from microbatch.memory import MemoryTracker, format_bytes
from microbatch.models import GPT, GPTConfig, token_loss
from microbatch.models.workloads import VarlenTokens, build_seeded

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, int]"]
Grads = dict[str, torch.Tensor]

TOOLS = {
    "microbatch": "microbatch `Accumulator`",
    "accelerate": "Accelerate `accumulate()`",
    "lightning": "Lightning `Trainer(accumulate_grad_batches)`",
    "hf_trainer": "HF `Trainer`, model takes `num_items_in_batch`",
    "hf_trainer_mean": "HF `Trainer`, model returns a mean loss",
    "nanogpt": "nanoGPT-style loop (loss / steps)",
}
CASES = {
    "equal": "(1) equal micro-batches",
    "varlen": "(2) variable-length tokens",
    "partial": "(3) partial last window",
    "clip": "(4) clipping",
}
EXACT = 1e-6  # float64: below this the difference is rounding; above it, a different gradient


def quiet_peers() -> None:
    """Keep the peers' progress lines and warnings off stdout (Lightning sets levels on import)."""
    with contextlib.suppress(ImportError):
        import lightning.pytorch  # noqa: F401
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()


# ------------------------------------------------------------------------------------------------
# Shared pieces


def concat(batches: Sequence[Any]) -> Any:
    """Micro-batches joined back into one batch (tensors, tuples or dicts of tensors)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches))
    if isinstance(first, dict):
        return {key: concat([b[key] for b in batches]) for key in first}
    return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))


def grads_of(model: nn.Module) -> Grads:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_relative_error(actual: Grads, expected: Grads) -> float:
    """max |actual - expected| / max |expected| over every element of every parameter."""
    if actual.keys() != expected.keys():
        return math.inf
    difference = max(float((actual[n] - expected[n]).abs().max()) for n in expected)
    return difference / max(float(expected[n].abs().max()) for n in expected)


@contextlib.contextmanager
def step_times() -> Iterator[list[tuple[float, float]]]:
    """(wall clock, this process's CPU time) after every optimizer step of any optimizer while open."""
    times: list[tuple[float, float]] = []
    handle = register_optimizer_step_post_hook(
        lambda *_: times.append((time.perf_counter(), time.process_time()))
    )
    try:
        yield times
    finally:
        handle.remove()


def seconds_per_step(times: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Median wall and CPU seconds between consecutive optimizer steps; the first step is warm-up.

    With one torch thread, CPU time is what the step itself costs: other processes on a shared
    machine stretch the wall clock but barely touch it.
    """
    out = {}
    for index, clock in enumerate(("wall", "cpu")):
        gaps = [b[index] - a[index] for a, b in itertools.pairwise(times[1:])]
        out[clock] = statistics.median(gaps) if gaps else math.nan
        out[f"{clock}_min"] = min(gaps) if gaps else math.nan
    return out


def loader(batches: Sequence[Any]) -> torch.utils.data.DataLoader[Any]:
    """A DataLoader that hands out the prepared micro-batches as they are, in order."""
    return torch.utils.data.DataLoader(list(batches), batch_size=None, shuffle=False)  # type: ignore[arg-type]


def lightning_trainer(*, steps: int, max_grad_norm: float | None, precision: str, **options: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="auto",
        devices=1,
        accumulate_grad_batches=steps,
        gradient_clip_val=max_grad_norm,
        precision=precision,  # type: ignore[arg-type]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )


def lightning_module(
    model: nn.Module, loss: LossFn, make_optimizer: Callable[[nn.Module], Any], **attributes: Any
) -> Any:
    """A LightningModule around ``model`` whose training_step returns the micro-batch's mean loss."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            for key, value in attributes.items():
                setattr(self, key, value)

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            return loss(self.model, batch)[0]

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.model)

    return Module()


# ------------------------------------------------------------------------------------------------
# The loops, one per tool, written the way each tool's documentation writes them. Each runs
# ``micro_batches`` in windows of ``steps``, clips to ``max_grad_norm`` when given, and steps.


def loop_microbatch(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    acc = mb.Accumulator(model, optimizer, steps=kw["steps"], max_grad_norm=kw["max_grad_norm"])
    for micro in acc.iterate(micro_batches):
        loss, items = kw["loss"](model, micro.batch)
        acc.backward(loss, items=items)  # loss is a mean over `items` samples or tokens
        if micro.is_last:
            acc.step()


def loop_accelerate(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # Accelerate keeps its state in process-wide singletons
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=kw["steps"], cpu=not torch.cuda.is_available())
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(micro_batches))
    for batch in data:
        with accelerator.accumulate(model):
            accelerator.backward(kw["loss"](model, batch)[0])  # divides by gradient_accumulation_steps
            if accelerator.sync_gradients and kw["max_grad_norm"] is not None:
                accelerator.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
            optimizer.step()  # skipped until the window's last micro-batch, or the data's end
            optimizer.zero_grad()


def loop_lightning(model: Any, make_optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    precision = "64-true" if next(model.parameters()).dtype == torch.float64 else "32-true"
    trainer = lightning_trainer(
        steps=kw["steps"], max_grad_norm=kw["max_grad_norm"], precision=precision, max_epochs=1
    )
    trainer.fit(lightning_module(model, kw["loss"], make_optimizer), loader(micro_batches))


def loop_nanogpt(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    steps = kw["steps"]  # nanoGPT's train.py: every window has `steps` micro-batches; it samples forever
    for start in range(0, len(micro_batches) - steps + 1, steps):
        for batch in micro_batches[start : start + steps]:
            (kw["loss"](model, batch)[0] / steps).backward()
        if kw["max_grad_norm"] is not None:
            nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class CountedLoss(nn.Module):
    """A model written the way transformers' own are: ``forward(**batch)`` returns the loss, and
    when the Trainer passes ``num_items_in_batch`` (the window's count of labels that are not
    -100) the loss is the sum over the micro-batch's items divided by it, else the mean.
    ``takes_count=False``: a model that returns its mean loss and takes no count (the Trainer reads
    ``accepts_loss_kwargs`` and then divides by the window's number of micro-batches)."""

    def __init__(
        self, model: nn.Module, loss: LossFn, unpack: Callable[[dict[str, Any]], Any], *, takes_count: bool
    ) -> None:
        super().__init__()
        self.model, self.loss, self.unpack = model, loss, unpack
        self.accepts_loss_kwargs = takes_count

    def forward(self, **batch: Any) -> dict[str, torch.Tensor]:
        window_items = batch.pop("num_items_in_batch", None)
        mean, items = self.loss(self.model, self.unpack(batch))
        return {"loss": mean if window_items is None else mean * items / window_items}


def loop_hf_trainer(
    model: Any, make_optimizer: Any, micro_batches: list[Any], *, takes_count: bool = True, **kw: Any
) -> None:
    import tempfile

    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # The Trainer batches the rows of a dataset itself; a tuple (inputs, targets) travels as a dict.
    as_dict = not isinstance(micro_batches[0], dict)
    batches = [{"inputs": b[0], "labels": b[1]} if as_dict else b for b in micro_batches]
    rows = [{key: value[i] for key, value in b.items()} for b in batches for i in range(len(b["labels"]))]
    unpack = (lambda b: (b["inputs"], b["labels"])) if as_dict else (lambda b: b)
    optimizer = make_optimizer(model)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=len(batches[0]["labels"]),
            gradient_accumulation_steps=kw["steps"],
            num_train_epochs=1,
            max_grad_norm=kw["max_grad_norm"] or 0.0,  # 0: no clipping
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = Trainer(
            model=CountedLoss(model, kw["loss"], unpack, takes_count=takes_count),
            args=args,
            train_dataset=rows,  # type: ignore[arg-type]
            optimizers=(optimizer, schedule),
        )
        trainer.train()


LOOPS = {"microbatch": loop_microbatch, "accelerate": loop_accelerate, "nanogpt": loop_nanogpt}
OWN_OPTIMIZER_LOOPS = {
    "lightning": loop_lightning,
    "hf_trainer": loop_hf_trainer,
    "hf_trainer_mean": functools.partial(loop_hf_trainer, takes_count=False),
}


def train(
    loop: str,
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], Any],
    micro_batches: list[Any],
    **kw: Any,
) -> None:
    """Run ``loop``: a key of LOOPS, or of OWN_OPTIMIZER_LOOPS (those call make_optimizer themselves)."""
    if loop in OWN_OPTIMIZER_LOOPS:
        OWN_OPTIMIZER_LOOPS[loop](model, make_optimizer, micro_batches, **kw)
    else:
        LOOPS[loop](model, make_optimizer(model), micro_batches, **kw)


# ------------------------------------------------------------------------------------------------
# 1. Correctness


@dataclass(frozen=True)
class Case:
    """Micro-batches in windows of ``steps``; the last window is compared with its full batch."""

    make_model: Callable[[], nn.Module]
    micro_batches: tuple[Any, ...]
    steps: int
    loss: LossFn
    clip_fraction: float | None = None  # clip to this fraction of the full batch's gradient norm

    @property
    def last_window(self) -> tuple[Any, ...]:
        return self.micro_batches[(len(self.micro_batches) - 1) // self.steps * self.steps :]


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets), int(inputs.shape[0])


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean next-token cross entropy over the non-padding tokens, and their count."""
    logits = model(batch["input_ids"])
    return token_loss(getattr(logits, "logits", logits), batch["labels"])  # HF models return an object


def mlp() -> nn.Module:
    return build_seeded(lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)), 0).double()


def tiny_lm() -> nn.Module:
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0)
    return build_seeded(lambda: GPT(config), 0).double()


def regression_batches(count: int, size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    generator = torch.Generator().manual_seed(1)
    shapes = ((size, 8), (size, 1))
    return tuple(
        tuple(torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes)  # type: ignore[misc]
        for _ in range(count)
    )


def correctness_cases() -> dict[str, Case]:
    tokens = VarlenTokens(block_size=32, min_length=2, seed=3)
    return {
        "equal": Case(mlp, regression_batches(4, 8), 4, mse_loss),
        "varlen": Case(tiny_lm, tuple(tokens(4) for _ in range(4)), 4, lm_loss),
        "partial": Case(mlp, regression_batches(7, 4), 4, mse_loss),
        "clip": Case(mlp, regression_batches(4, 8), 4, mse_loss, clip_fraction=0.25),
    }


def reference_grads(case: Case) -> tuple[Grads, float | None]:
    """The last window's full-batch gradient, clipped as a full-batch step would clip it."""
    model = case.make_model()
    case.loss(model, concat(case.last_window))[0].backward()
    max_grad_norm = None
    if case.clip_fraction is not None:
        norm = float(nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        max_grad_norm = case.clip_fraction * norm
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return grads_of(model), max_grad_norm


class RecordingSGD(torch.optim.SGD):
    """SGD with lr=0 that records the gradients it is handed, after running the step's closure.

    Lightning computes a window's last micro-batch and clips inside ``optimizer.step(closure)``, so
    a step pre-hook would fire too early; recording after the closure works for every tool.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.model = model
        self.recorded: list[Grads] = []

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.recorded.append(grads_of(self.model))
        super().step()
        return loss


def last_step_grads(tool: str, case: Case, max_grad_norm: float | None) -> Grads | None:
    """The gradients ``tool`` hands its optimizer at its last step; None where the case cannot arise."""
    if tool == "nanogpt" and len(case.micro_batches) % case.steps:
        return None  # it samples whole windows forever: there is no partial last window
    model = case.make_model()
    made: list[RecordingSGD] = []

    def make_optimizer(m: nn.Module) -> RecordingSGD:
        made.append(RecordingSGD(m))
        return made[-1]

    train(
        tool, model, make_optimizer, list(case.micro_batches),
        loss=case.loss, steps=case.steps, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    return made[-1].recorded[-1] if made and made[-1].recorded else {}


def run_correctness(tools: Sequence[str] = tuple(TOOLS)) -> dict[str, dict[str, float | None]]:
    """tool -> case -> max relative gradient error against the full batch (None: does not arise)."""
    errors: dict[str, dict[str, float | None]] = {tool: {} for tool in tools}
    for key, case in correctness_cases().items():
        expected, max_grad_norm = reference_grads(case)
        for tool in tools:
            actual = last_step_grads(tool, case, max_grad_norm)
            errors[tool][key] = None if actual is None else max_relative_error(actual, expected)
    return errors


# ------------------------------------------------------------------------------------------------
# 2. Speed, side by side


@dataclass(frozen=True)
class Setup:
    """The GPT-2 workload's size, the recipe (micro-batch x steps) and how long to time it."""

    n_layer: int
    n_embd: int
    block_size: int
    micro_batch_size: int
    steps: int
    timed_steps: int
    rounds: int
    shrink: int  # the budget fits micro-batches this many times smaller than the recipe's
    profile_max: int  # the largest micro-batch the planner profiles

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.steps


QUICK = Setup(
    n_layer=2,
    n_embd=64,
    block_size=64,
    micro_batch_size=4,
    steps=4,
    timed_steps=3,
    rounds=2,
    shrink=2,
    profile_max=8,
)
FULL = Setup(
    n_layer=4,
    n_embd=128,
    block_size=64,
    micro_batch_size=8,
    steps=4,
    timed_steps=10,
    rounds=8,
    shrink=4,
    profile_max=16,
)


def gpt2(setup: Setup) -> nn.Module:
    """transformers' GPT-2 at a CPU size: byte vocabulary, no dropout, random init (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=256, n_positions=setup.block_size, n_embd=setup.n_embd, n_layer=setup.n_layer, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return build_seeded(lambda: GPT2LMHeadModel(config), 0)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def token_batches(setup: Setup, count: int, size: int, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    make = VarlenTokens(block_size=setup.block_size, min_length=setup.block_size // 4, seed=seed)
    return [make(size) for _ in range(count)]


def hf_checkpoint_every_layer(model: nn.Module) -> nn.Module:
    """transformers' own activation checkpointing of every decoder layer (non-reentrant)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


def mb_checkpoint_every_block(model: nn.Module) -> nn.Module:
    from microbatch.checkpoint import checkpoint

    checkpoint(model, blocks="auto", policy="full")
    return model


@dataclass(frozen=True)
class Runner:
    """A loop (a key of LOOPS or "lightning"), and what is done to a fresh model copy first."""

    loop: str
    prepare: Callable[[nn.Module], Any] | None = None

    def seconds_per_step(self, base: nn.Module, micro_batches: list[Any], *, steps: int) -> dict[str, float]:
        model = copy.deepcopy(base)
        model.train()
        if self.prepare is not None:
            self.prepare(model)
        with step_times() as times:
            train(self.loop, model, adamw, micro_batches, loss=lm_loss, steps=steps, max_grad_norm=1.0)
        return seconds_per_step(times)


def speed_runners() -> dict[str, tuple[str, Runner]]:
    runners = {
        "nanogpt": ("hand-written nanoGPT-style loop (the baseline)", Runner("nanogpt")),
        **{tool: (TOOLS[tool], Runner(tool)) for tool in ("microbatch", "accelerate", "lightning")},
        "nanogpt+hf-checkpoint": (
            "nanoGPT-style loop + transformers gradient checkpointing (every layer)",
            Runner("nanogpt", hf_checkpoint_every_layer),
        ),
    }
    if importlib.util.find_spec("microbatch.checkpoint") is not None:
        runners["microbatch+checkpoint"] = (
            "microbatch `Accumulator` + `mb.checkpoint` (every block, full)",
            Runner("microbatch", mb_checkpoint_every_block),
        )
    return runners


def interleaved(
    runs: dict[str, Callable[[], dict[str, float]]], *, rounds: int, baseline: str
) -> dict[str, dict[str, float]]:
    """Every run once per round, in turn. Per key: median wall and CPU seconds per step, and the
    median over rounds of its CPU time over the baseline's in the same round (min and max too)."""
    seconds: dict[str, list[dict[str, float]]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            seconds[key].append(run())
    out = {}
    for key, values in seconds.items():
        ratios = {
            clock: [v[clock] / b[clock] for v, b in zip(values, seconds[baseline], strict=True)]
            for clock in ("wall", "cpu")
        }
        fastest = min(v["cpu_min"] for v in values)
        out[key] = {
            "seconds_per_step": statistics.median(v["wall"] for v in values),
            "cpu_seconds_per_step": statistics.median(v["cpu"] for v in values),
            "ratio": statistics.median(ratios["cpu"]),
            "ratio_min": min(ratios["cpu"]),
            "ratio_max": max(ratios["cpu"]),
            "wall_ratio": statistics.median(ratios["wall"]),
            # Load only ever adds time, so the fastest step of all rounds is the least disturbed one.
            "fastest_cpu_seconds": fastest,
            "fastest_ratio": fastest / min(v["cpu_min"] for v in seconds[baseline]),
        }
    return out


def run_speed(setup: Setup) -> dict[str, Any]:
    base = gpt2(setup)
    batches = token_batches(setup, setup.steps * (setup.timed_steps + 1), setup.micro_batch_size)
    runners = speed_runners()
    runs = {
        key: (lambda runner=runner: runner.seconds_per_step(base, batches, steps=setup.steps))
        for key, (_, runner) in runners.items()
    }
    timings = interleaved(runs, rounds=setup.rounds, baseline="nanogpt")  # type: ignore[arg-type]
    return {
        "setup": asdict(setup) | {"batch_size": setup.batch_size},
        "rows": [{"key": key, "label": label, **timings[key]} for key, (label, _) in runners.items()],
    }


# ------------------------------------------------------------------------------------------------
# 3. A smaller memory budget: each tool's own mechanism


class SimulatedBudget:
    """Out of memory above ``budget_bytes``, judged per micro-batch size from measured windows.

    ``peak_bytes(b)`` is the peak of a steady-state window of the plain loop at micro-batch ``b``
    (AdamW's state already made, two micro-batches, clipping, the step) under MemoryTracker.
    ``guard(model)`` makes the model's forward raise the CPU allocator's out-of-memory error for a
    micro-batch whose window would not fit, which is what find_executable_batch_size and Lightning's
    finder catch on a real device.
    """

    def __init__(self, setup: Setup, base: nn.Module) -> None:
        self.setup, self.base = setup, base
        self.budget_bytes = 0
        self._peaks: dict[tuple[bool, int], int] = {}

    def peak_bytes(self, size: int, *, hf_checkpoint: bool = False) -> int:
        if (hf_checkpoint, size) not in self._peaks:
            model = copy.deepcopy(self.base)
            model.train()
            if hf_checkpoint:
                hf_checkpoint_every_layer(model)
            optimizer = adamw(model)
            warm, *window = token_batches(self.setup, 3, size, seed=99)
            loop_nanogpt(model, optimizer, [warm], loss=lm_loss, steps=1, max_grad_norm=1.0)
            with MemoryTracker(model=model, optimizer=optimizer) as tracker:
                loop_nanogpt(model, optimizer, window, loss=lm_loss, steps=2, max_grad_norm=1.0)
            self._peaks[hf_checkpoint, size] = tracker.peak_bytes
        return self._peaks[hf_checkpoint, size]

    def fits(self, size: int, *, hf_checkpoint: bool = False) -> bool:
        return self.peak_bytes(size, hf_checkpoint=hf_checkpoint) <= self.budget_bytes

    def guard(self, model: nn.Module, *, hf_checkpoint: bool = False) -> Any:
        def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            size = int((args[0] if args else kwargs["input_ids"]).shape[0])
            if not self.fits(size, hf_checkpoint=hf_checkpoint):
                raise RuntimeError(
                    "DefaultCPUAllocator: can't allocate memory: simulated budget of "
                    f"{self.budget_bytes} bytes, micro-batch {size}"
                )

        return model.register_forward_pre_hook(check, with_kwargs=True)


@dataclass(frozen=True)
class Mechanism:
    """What one tool's mechanism chose under the budget (None: nothing runs), and its speed."""

    key: str
    label: str
    micro_batch_size: int | None = None
    steps: int | None = None
    effective_batch: int | None = None
    checkpointing: str = "none"
    peak_bytes: int | None = None
    seconds_per_step: float | None = None
    cpu_seconds_per_step: float | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        split = f"{self.micro_batch_size} x {self.steps}" if self.micro_batch_size else "nothing runs"
        return f"{self.label}: {split}, effective batch {self.effective_batch}, {self.note}".rstrip(", ")


def accelerate_finder(start: int, fits: Callable[[int], bool]) -> int:
    """The size Accelerate's find_executable_batch_size settles on, starting from ``start``."""
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=start)
    def probe(batch_size: int) -> int:
        if not fits(batch_size):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: simulated budget")
        return batch_size

    return int(probe())


def lightning_finder(budget: SimulatedBudget, start: int, steps: int) -> int:
    """Lightning's Tuner.scale_batch_size (binary search) on the guarded model."""
    from lightning.pytorch.tuner import Tuner

    model = copy.deepcopy(budget.base)
    handle = budget.guard(model)
    samples = token_batches(budget.setup, 1, 8 * start, seed=5)[0]
    rows = [{key: value[i] for key, value in samples.items()} for i in range(8 * start)]
    module = lightning_module(model, lm_loss, adamw, batch_size=start)
    module.train_dataloader = lambda: torch.utils.data.DataLoader(rows, batch_size=module.batch_size)
    trainer = lightning_trainer(steps=steps, max_grad_norm=1.0, precision="32-true", max_steps=1)
    try:
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=start, steps_per_trial=1)
    finally:
        handle.remove()
    return int(found if found is not None else module.batch_size)


def microbatch_plan(budget: SimulatedBudget, batch: int) -> tuple[Mechanism, Runner | None]:
    """microbatch's planner for the same batch and budget; its own trial window proves the fit."""
    row = Mechanism("microbatch-plan", "microbatch `plan(batch, memory=budget)`")
    try:
        from microbatch.planner import plan
    except ImportError as error:
        return replace(row, note=f"planner not available in this checkout ({error})"), None
    setup = budget.setup
    workload = mb.Workload(
        model=copy.deepcopy(budget.base),
        make_batch=VarlenTokens(block_size=setup.block_size, min_length=setup.block_size // 4, seed=11),
        loss=lm_loss,
        optimizer=adamw,
        name="gpt2",
    )
    try:
        chosen = plan(
            workload, batch=batch, memory=budget.budget_bytes, max_profile_micro_batch_size=setup.profile_max
        )
    except MicrobatchError as error:
        return replace(row, note=f"no plan: {error}"), None
    except Exception as error:  # the planner failing is a result to show, not a reason to lose the rest
        return replace(row, note=f"the planner failed: {error!r}"), None
    checkpointed = [policy for _, policy in chosen.block_policies if policy != "none"]
    kinds = ", ".join(sorted(set(checkpointed)))
    row = replace(
        row,
        micro_batch_size=chosen.micro_batch_size,
        steps=chosen.steps,
        effective_batch=sum(chosen.micro_batch_sizes),
        peak_bytes=chosen.measured_peak_bytes,
        checkpointing=f"{kinds}: {len(checkpointed)} of {len(chosen.block_policies)} blocks"
        if checkpointed
        else "none",
        note=f"peak from the plan's own trial; planning took {chosen.planning_seconds:.1f} s",
    )
    return row, Runner("microbatch", chosen.checkpoint)


def run_budget(setup: Setup) -> dict[str, Any]:
    """The recipe (micro-batch x steps) under a budget that fits micro-batches ``shrink`` x smaller."""
    base = gpt2(setup)
    batch = setup.batch_size
    recipe_micro, recipe_steps = 2 * setup.micro_batch_size, setup.steps // 2
    budget = SimulatedBudget(setup, base)
    budget.budget_bytes = int(budget.peak_bytes(recipe_micro // setup.shrink) * 1.01)
    rows: list[Mechanism] = []
    runners: dict[str, Runner] = {}

    def add(row: Mechanism, runner: Runner | None, *, hf_checkpoint: bool = False) -> None:
        if row.micro_batch_size is not None and row.peak_bytes is None:
            peak_bytes = budget.peak_bytes(row.micro_batch_size, hf_checkpoint=hf_checkpoint)
            row = replace(row, peak_bytes=peak_bytes)
        if runner is not None:
            runners[row.key] = runner
        rows.append(row)

    add(
        Mechanism("unconstrained", "hand-written loop, whole batch at once, no budget", batch, 1, batch),
        Runner("nanogpt"),
    )
    if budget.fits(recipe_micro):
        add(
            Mechanism("nanogpt", "nanoGPT-style loop, recipe as written", recipe_micro, recipe_steps, batch),
            Runner("nanogpt"),
        )
    else:
        add(
            Mechanism(
                "nanogpt", "nanoGPT-style loop, recipe as written", note="no mechanism: runs out of memory"
            ),
            None,
        )

    found = accelerate_finder(recipe_micro, budget.fits)
    add(
        Mechanism(
            "accelerate",
            "Accelerate `find_executable_batch_size`, steps unchanged (its docstring)",
            found,
            recipe_steps,
            found * recipe_steps,
        ),
        Runner("accelerate"),
    )
    kept = max(1, batch // found)
    add(
        Mechanism(
            "accelerate-example",
            "Accelerate `find_executable_batch_size`, steps = batch // found (its example script)",
            found,
            kept,
            found * kept,
            note="the user's own code recomputes the steps",
        ),
        Runner("accelerate"),
    )

    hf_found = accelerate_finder(recipe_micro, lambda size: budget.fits(size, hf_checkpoint=True))
    add(
        Mechanism(
            "hf-checkpoint",
            "transformers gradient checkpointing (every layer) + `auto_find_batch_size`",
            hf_found,
            recipe_steps,
            hf_found * recipe_steps,
            "every layer",
            note="as `TrainingArguments(gradient_checkpointing=True, auto_find_batch_size=True)`",
        ),
        Runner("nanogpt", hf_checkpoint_every_layer),
        hf_checkpoint=True,
    )

    try:
        found_l = lightning_finder(budget, recipe_micro, recipe_steps)
        add(
            Mechanism(
                "lightning",
                "Lightning `Tuner.scale_batch_size` (binsearch), accumulate_grad_batches unchanged",
                found_l,
                recipe_steps,
                found_l * recipe_steps,
                note="binary search, then its default 5 % safety margin",
            ),
            Runner("lightning"),
        )
    except Exception as error:  # a peer's own code failing is a result to report, not a crash
        add(Mechanism("lightning", "Lightning `Tuner.scale_batch_size`", note=f"failed: {error!r}"), None)

    add(*microbatch_plan(budget, batch))

    def run_of(row: Mechanism, runner: Runner) -> Callable[[], dict[str, float]]:
        total = row.effective_batch or 0
        sizes = micro_batch_sizes(total, row.micro_batch_size or total)
        windows = token_batches(setup, setup.timed_steps + 1, total, seed=7)
        micro = [part for window in windows for part in split_batch(window, sizes)]
        return lambda: runner.seconds_per_step(base, micro, steps=len(sizes))

    runs = {row.key: run_of(row, runners[row.key]) for row in rows if row.key in runners}
    timings = interleaved(runs, rounds=setup.rounds, baseline="unconstrained")
    rows = [
        replace(
            row,
            seconds_per_step=timings[row.key]["seconds_per_step"],
            cpu_seconds_per_step=timings[row.key]["cpu_seconds_per_step"],
        )
        if row.key in timings
        else row
        for row in rows
    ]
    return {
        "batch_size": batch,
        "recipe": {"micro_batch_size": recipe_micro, "steps": recipe_steps},
        "budget_bytes": budget.budget_bytes,
        "rows": [row.to_dict() for row in rows],
    }


# ------------------------------------------------------------------------------------------------
# Report


def _error_cell(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1e} ({'exact' if value <= EXACT else '**wrong**'})"


def _keep_cell(row: dict[str, Any] | None, batch: int) -> str:
    if row is None:
        return "not measured"
    effective = row.get("effective_batch")
    if effective is None:
        return f"no: {row.get('note') or 'nothing fits'}"
    split = f"{row['micro_batch_size']} x {row['steps']}"
    return f"yes: {batch} = {split}" if effective == batch else f"no: {batch} -> {effective} ({split})"


SHORT_NAMES = {
    "microbatch": "microbatch",
    "accelerate": "Accelerate",
    "lightning": "Lightning",
    "hf_trainer": "HF Trainer (count)",
    "hf_trainer_mean": "HF Trainer (mean)",
    "nanogpt": "nanoGPT",
}


def correctness_verdicts(errors: dict[str, dict[str, float | None]]) -> dict[str, str]:
    """Per case: is microbatch ahead, i.e. exact where a peer is not, and of which peers?"""
    verdicts = {}
    for case in CASES:
        ours = errors.get("microbatch", {}).get(case)
        peers = {tool: e.get(case) for tool, e in errors.items() if tool != "microbatch"}
        wrong = [SHORT_NAMES[t] for t, e in peers.items() if e is not None and e > EXACT]
        tied = [SHORT_NAMES[t] for t, e in peers.items() if e is not None and e <= EXACT]
        if ours is None or ours > EXACT:
            verdicts[case] = "**no**: microbatch is not exact"
        elif not wrong:
            verdicts[case] = "**no**: every tool is exact"
        elif tied:
            verdicts[case] = f"over {', '.join(wrong)}; **not** over {', '.join(tied)}"
        else:
            verdicts[case] = "yes"
    return verdicts


NOISE = 0.02  # ratios within 2 % of each other are level: interleaved rounds resolve no finer


def speed_verdict(speed: dict[str, Any]) -> tuple[bool, str]:
    """(microbatch not behind, the table's line), judged on the fastest steps' CPU time.

    Other processes only add time, so each loop's fastest step over all rounds is its least disturbed
    cost; the medians of the per-round ratios, and their spread, are quoted beside it.
    """
    rows = {row["key"]: row for row in speed["rows"]}
    peers = ("accelerate", "lightning", "nanogpt")
    best = min(peers, key=lambda k: rows[k]["fastest_ratio"])
    ours, theirs = rows["microbatch"]["fastest_ratio"], rows[best]["fastest_ratio"]
    spread = max((rows[k]["ratio_max"] - rows[k]["ratio_min"]) / 2 for k in ("microbatch", best))
    text = (
        f"fastest step {ours:.3f}x the hand-written loop's; the fastest peer loop, {TOOLS[best]}: "
        f"{theirs:.3f}x (medians of the rounds: {rows['microbatch']['ratio']:.3f}x and "
        f"{rows[best]['ratio']:.3f}x, +-{spread:.0%} over rounds)"
    )
    if ours < theirs * (1 - NOISE):
        return True, "yes: " + text
    if ours <= theirs * (1 + NOISE):
        return True, f"level (within {NOISE:.0%}): " + text
    return False, "**no**: " + text


def budget_verdict(budget: dict[str, Any]) -> tuple[bool, str]:
    """(microbatch not behind, the table's line): CPU time per sample among the batch keepers."""
    rows = {row["key"]: row for row in budget["rows"]}
    ours = rows.get("microbatch-plan", {})
    if not ours.get("effective_batch"):
        return False, f"**no**: microbatch found no plan ({ours.get('note', '')})"

    def config(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row["micro_batch_size"], row["steps"], row["checkpointing"])

    rate = ours["effective_batch"] / ours["cpu_seconds_per_step"]
    faster = [
        r for k, r in rows.items()
        if k not in ("unconstrained", "microbatch-plan") and r.get("cpu_seconds_per_step")
        and r.get("effective_batch") == budget["batch_size"] and config(r) != config(ours)
        and r["effective_batch"] / r["cpu_seconds_per_step"] > rate * (1 + NOISE)
    ]  # fmt: skip
    if faster:
        return False, "**no**: faster per sample at the same batch: " + "; ".join(r["label"] for r in faster)
    same = [
        r["label"]
        for k, r in rows.items()
        if k != "microbatch-plan"
        and r.get("micro_batch_size")
        and config(r) == config(ours)
        and r.get("effective_batch") == budget["batch_size"]
    ]
    tie = f"; the same configuration as {', '.join(same)}" if same else ""
    return True, "yes: no mechanism that keeps the recipe's batch is faster per sample" + tie


def render(report: dict[str, Any]) -> str:
    env = results.environment_line(report["environment"])
    lines = [
        f"Made by `{report['bench_command']}`, which runs `{report['command']}`"
        f"{' (quick sizes: a smoke run)' if report['quick'] else ''}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        "",
    ]
    budget = report.get("budget")
    keeps = {row["key"]: row for row in budget["rows"]} if budget else {}
    batch = budget["batch_size"] if budget else 0
    errors = report.get("correctness")
    if errors:
        keep_of = {
            "microbatch": "microbatch-plan",
            "accelerate": "accelerate",
            "lightning": "lightning",
            "hf_trainer": "hf-checkpoint",
            "hf_trainer_mean": "hf-checkpoint",
            "nanogpt": "nanogpt",
        }
        rows = []
        for tool in errors:
            keep = _keep_cell(keeps.get(keep_of[tool]), batch) if budget else "not measured"
            if tool == "accelerate" and "accelerate-example" in keeps:
                example = keeps["accelerate-example"]["effective_batch"]
                keep += f"; its example script keeps {example} by recomputing steps"
            if tool.startswith("hf_trainer") and budget:
                keep += "; `auto_find_batch_size` with checkpointing of every layer"
            rows.append([TOOLS[tool], *(_error_cell(errors[tool].get(c)) for c in CASES), keep, env])
        verdicts = correctness_verdicts(errors)
        keep_verdict = "not measured"
        if budget:
            kept = {
                SHORT_NAMES[tool]: keeps.get(keep_of[tool], {}).get("effective_batch") == batch
                for tool in errors
                if tool != "microbatch"
            }
            if keeps.get("microbatch-plan", {}).get("effective_batch") != batch:
                keep_verdict = "**no**: microbatch did not keep it"
            elif any(kept.values()):
                lost = ", ".join(name for name, k in kept.items() if not k)
                keeping = ", ".join(name for name, k in kept.items() if k)
                keep_verdict = f"over {lost}; **not** over {keeping}"
            else:
                keep_verdict = "yes"
        rows.append(["**microbatch ahead?**", *(verdicts[c] for c in CASES), keep_verdict, ""])
        headers = [
            "tool",
            *CASES.values(),
            f"keeps the effective batch ({batch}) when memory shrinks",
            "measured on",
        ]
        lines += [
            "### Correctness",
            "",
            "Gradient handed to the optimizer vs the full batch's, float64: max |g - g_full| / "
            f"max |g_full| (exact: at most {EXACT:g}). Memory column: each tool's own batch-size "
            "mechanism under the budget of the last table.",
            "",
            results.markdown_table(headers, rows),
            "",
        ]
    speed = report.get("speed")
    if speed:
        s = speed["setup"]
        rows = [
            [
                row["label"],
                f"{row['cpu_seconds_per_step'] * 1e3:.1f}",
                f"**{row['fastest_ratio']:.3f}**",
                f"{row['ratio']:.3f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})",
                f"{row['seconds_per_step'] * 1e3:.1f} ({row['wall_ratio']:.2f})",
                env,
            ]
            for row in speed["rows"]
        ]
        lines += [
            "### Speed, side by side",
            "",
            f"transformers GPT-2 ({s['n_layer']} layers, width {s['n_embd']}, {s['block_size']} tokens, "
            f"random init) on variable-length byte sequences; batch {s['batch_size']} = micro-batch "
            f"{s['micro_batch_size']} x {s['steps']} steps; AdamW; clipping at 1.0; "
            f"{report['torch_threads']} torch thread(s). Medians over {s['rounds']} interleaved rounds of "
            f"{s['timed_steps']} timed optimizer steps, on this process's CPU time (what the step costs; "
            "other processes on a shared machine mostly stretch the wall clock, shown last). Ratios: each "
            "loop's fastest step over all rounds against the hand-written loop's (load only adds time), "
            "and the median over rounds of the ratio within a round.",
            "",
            results.markdown_table(
                [
                    "loop",
                    "CPU ms per optimizer step",
                    "x hand-written loop, fastest step (CPU)",
                    "x hand-written loop, median of rounds (min-max)",
                    "wall ms (x hand-written)",
                    "measured on",
                ],
                rows,
            ),
            "",
            f"microbatch ahead? {speed_verdict(speed)[1]}.",
            "",
        ]
    if budget:
        recipe = budget["recipe"]
        base = keeps["unconstrained"]
        base_rate = (
            base["effective_batch"] / base["cpu_seconds_per_step"]
            if base.get("cpu_seconds_per_step")
            else None
        )
        rows = []
        for row in budget["rows"]:
            seconds, effective = row.get("cpu_seconds_per_step"), row.get("effective_batch")
            rate = effective / seconds if seconds and effective else None
            rows.append([
                row["label"],
                f"{row['micro_batch_size']} x {row['steps']}" if row.get("micro_batch_size") else "-",
                row["checkpointing"] if effective else "-",
                effective or "-",
                format_bytes(row["peak_bytes"]) if row.get("peak_bytes") else "-",
                f"{seconds * 1e3:.1f}" if seconds else "-",
                f"**{base_rate / rate:.2f}**" if rate and base_rate else "-",
                row.get("note", ""),
                env,
            ])  # fmt: skip
        headers = [
            "mechanism",
            "micro-batch x steps",
            "checkpointing",
            "effective batch",
            "peak",
            "CPU ms per step",
            "CPU time per sample x no budget",
            "note",
            "measured on",
        ]
        lines += [
            "### At a smaller memory budget",
            "",
            f"Recipe: batch {budget['batch_size']} = micro-batch {recipe['micro_batch_size']} x "
            f"{recipe['steps']} steps. Budget: {format_bytes(budget['budget_bytes'])} of peak live tensor "
            "memory, where the recipe's micro-batch does not fit. Peaks: steady-state windows under "
            "MemoryTracker.",
            "",
            results.markdown_table(headers, rows),
            "",
            f"microbatch ahead? {budget_verdict(budget)[1]}.",
            "",
        ]
    lines += ["### Notes", "", *report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def closing_notes(report: dict[str, Any]) -> list[str]:
    """How each tool ran, and where microbatch is not ahead: why, and what would change it."""
    notes = [
        "- How each ran: Accelerate for real (`Accelerator.accumulate()`, `accelerator.backward`, a "
        "prepared DataLoader, `clip_grad_norm_` when `sync_gradients`); Lightning for real "
        "(`lightning.pytorch.Trainer` on CPU, `accumulate_grad_batches`, `gradient_clip_val`); the "
        "HF `Trainer` for real (`gradient_accumulation_steps`, `max_grad_norm`, sequential sampling), "
        "once with a model that takes `num_items_in_batch` as transformers' own models do and once with "
        "one that returns its mean loss; the nanoGPT-style loop as nanoGPT's train.py writes it (it "
        "samples whole windows forever, so case (3) does not arise: n/a).",
    ]
    errors = report.get("correctness")
    if errors:
        verdicts = correctness_verdicts(errors)
        ties = [CASES[c] for c, v in verdicts.items() if v.startswith("**no**: every")]
        if ties:
            notes.append(
                f"- Not ahead on {', '.join(ties)}: dividing by the step count is exact when every "
                "micro-batch holds as many items and every window as many micro-batches, and every tool "
                "clips once, on the accumulated gradient. Nothing would change that: it is the case all "
                "of them were built for."
            )
        hf_ties = [CASES[c] for c, v in verdicts.items() if "**not** over" in v and "HF Trainer (count)" in v]
        if hf_ties:
            notes.append(
                f"- Not ahead of the HF Trainer on {', '.join(hf_ties)} when the model takes "
                "`num_items_in_batch`: the Trainer fetches each window's micro-batches before the first "
                "backward and counts their labels, so it divides by the right total. microbatch reaches the "
                "same gradient without fetching ahead (each backward weighs by its own count, one division "
                "at `step()`), in the user's own loop. In gradient terms nothing changes that: exact is "
                "exact. It is ahead where the model takes no count (the next row: the Trainer then divides "
                "each mean by the window's number of micro-batches, exact for a short last window of "
                "equal micro-batches, wrong for variable lengths) or where a window cannot be held in "
                "memory at once."
            )
    speed = report.get("speed")
    if speed and not speed_verdict(speed)[0]:
        notes.append(
            "- Not ahead on speed: per micro-batch the Accumulator scales the loss by its item count "
            "and adds it to a float64 running sum (a few scalar ops); per window it multiplies every "
            "gradient once more (`_foreach_mul_`, one pass over the gradients) and reads the sum back. "
            "On a model this small that shows; it does not grow with the micro-batch, so it shrinks "
            "as models grow, and folding the one multiplication into the clipping factor "
            "(`clip_grad_norm_` already multiplies every gradient) would remove the extra pass."
        )
    budget = report.get("budget")
    if budget and budget_verdict(budget)[0] and "the same configuration as" in budget_verdict(budget)[1]:
        notes.append(
            "- Level under the budget with a hand-tuned peer: the plan chose the configuration that "
            "mechanism reached too (see the table), because at this size no checkpointing lets a "
            "larger micro-batch pay for its recompute. microbatch's difference there is not speed: it "
            "needs no hand-written recomputation of the steps, stays exact with a short last "
            "micro-batch, and proves the fit in a trial window. Where recomputing some blocks buys a "
            "larger micro-batch that runs faster per sample (bigger models, GPUs), the plan moves ahead."
        )
    if budget and not budget_verdict(budget)[0]:
        plan_row = next(r for r in budget["rows"] if r["key"] == "microbatch-plan")
        if not plan_row.get("effective_batch"):
            notes.append(
                "- Not ahead under the budget: the planner found no plan. It adds what it measured for "
                "parameters, gradients, optimizer state, activations and a slack; at sizes this small "
                "the fixed parts dominate, so it can refuse a budget the plain loop meets by a few "
                "percent. Trying the smallest candidate for real before refusing would change it."
            )
        else:
            notes.append(
                "- Not ahead under the budget: a mechanism that keeps the batch ran faster per sample "
                "than the plan. The planner ranks candidates by profiled medians, and on a loaded "
                "machine those drift between profiling and the timed rounds; timing the top few "
                "candidates in its trial would change it."
            )
    return notes


def plots(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Bar-chart specifications that ``microbatch bench`` draws (see microbatch.commands.bench)."""
    specs: list[dict[str, Any]] = []
    errors = report.get("correctness")
    if errors:
        specs.append({
            "name": "peers-gradient-error",
            "kind": "bar",
            "title": "Gradient error against the full batch (float64; lower is better)",
            "ylabel": "max relative error",
            "log": True,
            "labels": list(CASES.values()),
            "series": {SHORT_NAMES[tool]: [errors[tool].get(c) for c in CASES] for tool in errors},
            "reference": {"value": EXACT, "label": f"exact: at most {EXACT:g}"},
        })  # fmt: skip
    if report.get("speed"):
        rows = report["speed"]["rows"]
        specs.append({
            "name": "peers-speed",
            "kind": "barh",
            "title": "Fastest optimizer step (CPU time), x the hand-written loop (lower is better)",
            "ylabel": "x hand-written loop",
            "labels": [row["label"] for row in rows],
            "series": {"fastest step": [row["fastest_ratio"] for row in rows]},
            "reference": {"value": 1.0, "label": "hand-written loop"},
        })  # fmt: skip
    return specs


def versions() -> dict[str, str]:
    found = {"microbatch": mb.__version__, "torch": torch.__version__}
    for name in ("accelerate", "lightning", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = "not installed"
    return found


PARTS = ("correctness", "speed", "budget")


def build_report(*, quick: bool, parts: Sequence[str] = PARTS, threads: int = 1) -> dict[str, Any]:
    """Run the parts; ``quick`` uses small sizes and two rounds."""
    began = time.perf_counter()
    torch.set_num_threads(threads)  # one thread: the least noise on a shared machine
    quiet_peers()
    setup = QUICK if quick else FULL
    command = "python benchmarks/peers.py" + (" --quick" if quick else "")
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


if __name__ == "__main__":
    sys.exit(main())
