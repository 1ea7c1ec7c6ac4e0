"""The shared protocol of the peers benchmark: the tools and cases, gradients and step timing,
the workloads (regression, tiny LM, GPT-2), the sizes (Setup) and what a budget mechanism reports."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

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
    from microbatch.checkpointing.api import checkpoint

    checkpoint(model, blocks="auto", policy="full")
    return model


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
