"""Contrastive training at the recipe's batch: gradient caching vs the full batch, and what others do.

A small CLIP-style dual encoder (two MLP towers, symmetric InfoNCE with a learned temperature) on
CPU. Two measurements, side by side in one run:

1. Memory and time: one training step (forward + backward) of batch B (64, 256) at once, with
   ``mb.cached_backward`` in encode micro-batches of m, and (for its time: what fits otherwise)
   plain accumulation of the per-micro-batch loss, which gives another gradient. Peak live tensor
   bytes by MemoryTracker
   (gradients already allocated, as in every step after the first); seconds per sample, the two
   forms timed alternately in rounds, medians.
2. Gradient error (float64, batch 64 in 4 micro-batches of 16) against the full batch's gradient,
   max|a - G| / max|G| over parameters, for: plain accumulation (loss / steps per micro-batch);
   the HF Trainer with gradient_accumulation_steps=4 (a real Trainer, one optimizer step, gradients
   captured in on_pre_optimizer_step); Accelerate's ``accumulate()`` (a real Accelerator); and
   ``cached_backward``. The first three compute each micro-batch's own InfoNCE (15 negatives
   instead of 63): no normalisation makes that the full batch's loss.

    python benchmarks/contrastive.py                      # prints, writes the RESULTS.md section
    python benchmarks/contrastive.py --quick --no-write
    python benchmarks/contrastive.py --sentence-transformers   # ST's CachedMNRL beside CachedSentenceLoss
    microbatch bench contrastive
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results

SECTION_TITLE = "Contrastive (gradient caching)"


class Tower(nn.Module):
    def __init__(self, features: int, width: int, dim: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.0)]
        layers.append(nn.Linear(width, dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DualEncoder(nn.Module):
    def __init__(self, *, features: int, width: int, dim: int, depth: int) -> None:
        super().__init__()
        self.image = Tower(features, width, dim, depth)
        self.text = Tower(features, width, dim, depth)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(image), self.text(text)

    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch["image"], batch["text"])

    def loss(self, representations: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Symmetric InfoNCE over the batch it is given."""
        image, text = representations
        logits = self.log_scale.exp() * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
        target = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def make_batch(size: int, features: int, *, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(size, features, generator=generator, dtype=dtype)
    text = image + 0.5 * torch.randn(size, features, generator=generator, dtype=dtype)
    return {"image": image, "text": text}


# ---------------------------------------------------------------------- 1. memory and time


def full_step(model: DualEncoder, batch: dict[str, torch.Tensor]) -> None:
    model.loss(model.encode(batch)).backward()


def plain_step(model: DualEncoder, batch: dict[str, torch.Tensor], micro: int) -> None:
    """What fits without caching: each micro-batch's own InfoNCE, accumulated (another gradient)."""
    total = batch["image"].shape[0]
    for start in range(0, total, micro):
        piece = {k: v[start : start + micro] for k, v in batch.items()}
        (model.loss(model.encode(piece)) * (piece["image"].shape[0] / total)).backward()


def cached_step(model: DualEncoder, batch: dict[str, torch.Tensor], micro: int) -> None:
    mb.cached_backward(model.encode, batch, model.loss, micro_batch_size=micro)


def peak(model: nn.Module, step: Callable[[], None]) -> dict[str, int]:
    step()  # gradients allocated, as in every later step
    with mb.MemoryTracker("cpu", model=model) as tracker:
        step()
    weights = tracker.breakdown["parameters"] + tracker.breakdown["gradients"]
    return {"peak_bytes": tracker.peak_bytes, "above_weights_bytes": tracker.peak_bytes - weights}


def timed(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per step of each form, run alternately (order rotating) so load hits all alike."""
    return {name: statistics.median(values) for name, values in timed_rounds(steps, rounds).items()}


def timed_rounds(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each form in each round: every round runs every form once, the order rotating by one
    form a round (round r starts with form r mod n), after one warm-up step of each."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for name in names:
        steps[name]()  # warm-up
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def one_batch_size(sizes: dict[str, int], batch_size: int, micro: int, rounds: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = DualEncoder(**sizes)
    batch = make_batch(batch_size, sizes["features"], seed=1, dtype=torch.float32)
    forms: dict[str, Callable[[], None]] = {
        "full batch": lambda: full_step(model, batch),
        f"plain accumulation, micro {micro} (inexact)": lambda: plain_step(model, batch, micro),
        f"cached, micro {micro}": lambda: cached_step(model, batch, micro),
    }
    memory = {name: peak(model, step) for name, step in forms.items()}
    seconds = timed(forms, rounds)
    return [
        {"batch": batch_size, "form": name, **memory[name], "seconds_per_step": seconds[name]}
        for name in forms
    ]


def memory_and_time(
    sizes: dict[str, int], batches: list[int], micro: int, rounds: int
) -> list[dict[str, Any]]:
    return [row for batch_size in batches for row in one_batch_size(sizes, batch_size, micro, rounds)]


# ---------------------------------------------------------------------- 2. gradient error


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|a - G| / max|G|."""
    return max(float((actual[n] - g).abs().max() / g.abs().max()) for n, g in expected.items())


def fresh_model(sizes: dict[str, int]) -> DualEncoder:
    torch.manual_seed(0)
    return DualEncoder(**sizes).double()


def plain_accumulation(
    model: DualEncoder, batch: dict[str, torch.Tensor], micro: int
) -> dict[str, torch.Tensor]:
    total = batch["image"].shape[0]
    steps = total // micro
    for start in range(0, total, micro):
        piece = {k: v[start : start + micro] for k, v in batch.items()}
        (model.loss(model.encode(piece)) / steps).backward()
    return grads_of(model)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_accumulate(
    model: DualEncoder, batch: dict[str, torch.Tensor], micro: int
) -> dict[str, torch.Tensor]:
    """Accelerate's documented loop: accumulate(model), accelerator.backward(loss), step when synced."""
    from accelerate import Accelerator

    _reset_accelerate()
    total = batch["image"].shape[0]
    accelerator = Accelerator(gradient_accumulation_steps=total // micro, cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    captured: dict[str, torch.Tensor] = {}
    for start in range(0, total, micro):
        piece = {k: v[start : start + micro] for k, v in batch.items()}
        with accelerator.accumulate(model):
            accelerator.backward(model.loss(model.encode(piece)))
            if accelerator.sync_gradients:
                captured = grads_of(model)
            optimizer.step()
            optimizer.zero_grad()
    _reset_accelerate()
    return captured


def hf_trainer(
    model: DualEncoder, batch: dict[str, torch.Tensor], micro: int, workdir: str
) -> dict[str, torch.Tensor]:
    """A real transformers Trainer, gradient_accumulation_steps = batch / micro, one optimizer step."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    total = batch["image"].shape[0]
    rows = [{k: v[i] for k, v in batch.items()} for i in range(total)]
    captured: dict[str, torch.Tensor] = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            captured.update(grads_of(model))

    class ContrastiveTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            return model.loss(model.encode(inputs))

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return SequentialSampler(rows)  # the same micro-batches as the other forms

    arguments = TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=total // micro,
        max_steps=1,
        learning_rate=0.0,
        max_grad_norm=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = ContrastiveTrainer(model=model, args=arguments, train_dataset=rows, callbacks=[Capture()])
    trainer.train()
    _reset_accelerate()
    return captured


def gradient_errors(sizes: dict[str, int], batch_size: int, micro: int) -> list[dict[str, Any]]:
    import tempfile

    batch = make_batch(batch_size, sizes["features"], seed=2, dtype=torch.float64)
    model = fresh_model(sizes)
    model.loss(model.encode(batch)).backward()
    expected = grads_of(model)
    forms: dict[str, Callable[[DualEncoder], dict[str, torch.Tensor]]] = {
        "plain accumulation (loss / steps)": lambda m: plain_accumulation(m, batch, micro),
        "Accelerate accumulate()": lambda m: accelerate_accumulate(m, batch, micro),
        f"mb.cached_backward (micro {micro})": lambda m: (cached_step(m, batch, micro), grads_of(m))[1],
    }
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        forms["HF Trainer gradient_accumulation_steps"] = lambda m: hf_trainer(m, batch, micro, workdir)
        for name, run in forms.items():
            try:
                error: float | str = relative_error(run(fresh_model(sizes)), expected)
            except Exception as failure:  # an optional package missing or changed: say so in the table
                error = f"not run: {type(failure).__name__}: {failure}"[:120]
            rows.append({"form": name, "max_rel_error": error})
    return rows


# ---------------------------------------------------------------------- report


def markdown(report: dict[str, Any], command: str) -> str:
    env = results.environment_line(report["environment"])
    sizes = report["sizes"]
    lines = [
        f"Dual encoder: two MLP towers ({sizes['features']} features, width {sizes['width']}, "
        f"{sizes['depth']} hidden layers, {sizes['dim']}-dim representations), symmetric InfoNCE with a "
        "learned temperature, float32 on CPU. One training step (forward + backward); peak live tensor "
        'bytes by MemoryTracker with gradients already allocated; "above weights" excludes parameters '
        "and gradients. Times are medians over alternating rounds, measured while other jobs loaded the "
        f"machine (load average {report['load_average']}): read the ratios, not the seconds.",
        "",
    ]
    table = []
    by_batch: dict[int, dict[str, Any]] = {}
    for row in report["memory_and_time"]:
        by_batch.setdefault(row["batch"], {})[row["form"]] = row
    for batch, forms in by_batch.items():
        full = forms["full batch"]
        for name, row in forms.items():
            table.append(
                [
                    batch,
                    name,
                    mb.format_bytes(row["peak_bytes"]),
                    mb.format_bytes(row["above_weights_bytes"]),
                    f"{row['above_weights_bytes'] / full['above_weights_bytes']:.2f}",
                    f"{1e3 * row['seconds_per_step'] / batch:.3f}",
                    f"{row['seconds_per_step'] / full['seconds_per_step']:.2f}",
                    env,
                ]
            )
    headers = [
        "batch",
        "form",
        "peak",
        "above weights",
        "vs full",
        "ms / sample",
        "time vs full",
        "measured on",
    ]
    lines += [results.markdown_table(headers, table), ""]
    ratios = []
    for batch, forms in by_batch.items():
        plain = next(row for name, row in forms.items() if name.startswith("plain"))
        cached = next(row for name, row in forms.items() if name.startswith("cached"))
        ratios.append(f"{cached['seconds_per_step'] / plain['seconds_per_step']:.2f} at batch {batch}")
    lines += [
        "Time of the cached step over plain accumulation in the same micro-batches: "
        f"{', '.join(ratios)}: the price of the extra forward pass per sample. Both are slower than the "
        "whole batch at once here because on a CPU matrix products of 16 rows run less efficiently; the "
        "memory column is the point: the cached step holds one micro-batch's activations plus the "
        "representations, and its gradient is the full batch's.",
        "",
    ]
    grad = report["gradient_error"]
    lines += [
        f"Gradient error of the same loss at batch {grad['batch']} in micro-batches of {grad['micro']} "
        "(float64; max|a - G| / max|G| over parameters, G the full batch's gradient). Accumulating the "
        "per-micro-batch InfoNCE changes the loss itself, whatever the normalisation:",
        "",
        results.markdown_table(
            ["form", "max rel error", "measured on"],
            [
                [
                    r["form"],
                    r["max_rel_error"]
                    if isinstance(r["max_rel_error"], str)
                    else f"{r['max_rel_error']:.2e}",
                    env,
                ]
                for r in grad["rows"]
            ],
        ),
        "",
        f"Reproduce: `{command}`",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if "--sentence-transformers" in arguments:  # sentence-transformers' cached loss beside ours
        import contrastive_st

        return contrastive_st.main([a for a in arguments if a != "--sentence-transformers"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=16, help="encode micro-batch size of the cached form")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per form")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small model, few rounds")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = {"features": 256, "width": 512, "dim": 128, "depth": 8}
    batches = [64, 256]
    if args.quick:
        sizes, batches, args.rounds = {"features": 32, "width": 64, "dim": 16, "depth": 2}, [32, 64], 2
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report: dict[str, Any] = {
            "sizes": sizes,
            "micro": args.micro,
            "memory_and_time": memory_and_time(sizes, batches, args.micro, args.rounds),
            "gradient_error": {
                "batch": 64,
                "micro": 16,
                "rows": gradient_errors({**sizes, "width": min(sizes["width"], 64)}, 64, 16),
            },
        }
    report["environment"] = results.environment()
    report["load_average"] = (
        ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    )
    command = results.reproducing_command(
        "contrastive", sys.argv[1:] if argv is None else list(argv), json_mode=args.json
    )
    report["command"] = command
    text = markdown(report, command)
    return results.emit(
        SECTION_TITLE, text, report, json_mode=args.json, write=not (args.no_write or args.quick)
    )


if __name__ == "__main__":
    sys.exit(main())
