"""Real torchvision models (no weights): auto blocks, exact gradients, plans under a budget, speed.

Not run by CI: needs torchvision, which does not install beside the project's torch 2.13 pin. Run it
in its own venv (both wheels lie on this machine's disk):

    python -m venv /work/venv-tv
    /work/venv-tv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm numpy matplotlib
    /work/venv-tv/bin/pip install --no-deps -e .
    /work/venv-tv/bin/python benchmarks/vision_real.py [--quick] [--models resnet50,...] [--json]

Per model, built with weights=None and random images (nothing downloaded):

1. ``blocks="auto"``: what it picks.
2. Gradients, float64, a batch of 4: the checkpointed model (auto blocks, policy full and policy
   selective) against the plain one, BatchNorm kept (running statistics compared too); and, after
   ``convert_batchnorm_to_groupnorm``, two micro-batches of 2 through ``mb.Accumulator`` against the
   full batch of 4. Relative error: max over tensors of max|g - g_ref| / max|g_ref|.
3. Plans at batch 32 under a budget halfway between the planner's predicted no-checkpoint peaks of
   micro-batch 2 and 3, so that without checkpointing only micro-batches of 2 fit:
       none        micro-batches of 2, no checkpointing
       everything  every auto block "full", the largest micro-batch the profile says fits
       plan        mb.plan(...)                    the planner's choice (none / full / selective)
   all with min_micro_batch_size=2 (deeplab's ASPP has BatchNorm after global pooling) and one
   shared profile. Each trains whole windows of 32 on its own model copy (SGD); peak: MemoryTracker
   over one window and step; time: the fastest of interleaved rounds.
4. torch.compile (backend aot_eager) of the plan's checkpointed model, one micro-batch: compile
   time and the gradient against eager (float32), for the models in --compile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
import results
from microbatch.checkpointing.auto_blocks import describe_blocks
from microbatch.errors import InfeasibleBudgetError
from microbatch.memory import format_bytes
from microbatch.planner.search.sizes import Model
from microbatch.profile import NONE, profile_workload
from microbatch.trees.batches import micro_batch_sizes

try:
    import torchvision
except ImportError:  # the project's own environment: skipped, see the module docstring
    torchvision = None

SECTION_TITLE = "Real torchvision models"
# Models that downsample 32x (or, for vit_b_16, fix the image size): the float64 checks use --image.
DOWNSAMPLE_32X = frozenset({"vit_b_16", "convnext_tiny", "swin_t"})
BATCH = 32
CLASSES = 10
SEGMENT_CLASSES = 4


def builders(image: int) -> dict[str, tuple[Callable[[], nn.Module], bool]]:
    """name -> (build, is_segmentation); weights=None everywhere."""
    tv = torchvision.models
    seg = tv.segmentation
    return {
        "resnet50": (lambda: tv.resnet50(weights=None, num_classes=CLASSES), False),
        "convnext_tiny": (lambda: tv.convnext_tiny(weights=None, num_classes=CLASSES), False),
        "efficientnet_b0": (lambda: tv.efficientnet_b0(weights=None, num_classes=CLASSES), False),
        "vit_b_16": (lambda: tv.vit_b_16(weights=None, image_size=image, num_classes=CLASSES), False),
        "swin_t": (lambda: tv.swin_t(weights=None, num_classes=CLASSES), False),
        "deeplabv3_mobilenet_v3_large": (
            lambda: seg.deeplabv3_mobilenet_v3_large(
                weights=None, weights_backbone=None, num_classes=SEGMENT_CLASSES
            ),
            True,
        ),
        "deeplabv3_resnet50": (
            lambda: seg.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=SEGMENT_CLASSES),
            True,
        ),
    }


def make_workload(name: str, image: int) -> mb.Workload:
    build, segmentation = builders(image)[name]
    torch.manual_seed(0)
    model = build()
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn(size, 3, image, image, generator=generator)
        if segmentation:
            return images, torch.randint(0, SEGMENT_CLASSES, (size, image, image), generator=generator)
        return images, torch.randint(0, CLASSES, (size,), generator=generator)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        images, labels = batch
        out = module(images)
        return F.cross_entropy(out["out"] if segmentation else out, labels), int(images.shape[0])

    def optimizer(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=0.01)  # see Runner

    return mb.Workload(model, make_batch, loss, optimizer=optimizer, name=f"{name}-{image}px")


# --------------------------------------------------------------------------------------------------
# Gradients


def _relative_error(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if w is None or g is None:
            if (w is None) != (g is None):
                return float("inf")
            continue
        scale = w.abs().max().item()
        worst = max(worst, (g - w).abs().max().item() / scale if scale else (g - w).abs().max().item())
    return worst


def _grads_after(model: nn.Module, work: mb.Workload, batch: Any, seed: int) -> list[torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss, _ = work.loss(model, batch)
    loss.backward()
    return [p.grad for p in model.parameters()]


def gradient_checks(work: mb.Workload, image: int) -> dict[str, float]:
    """Float64 on CPU is slow for depthwise convolutions (efficientnet_b0 at 32 px: 90 s per step on
    the shared machine), so the checks run at ``image`` px, smaller than the speed runs."""
    images, labels = _resized(work.make_batch(4), image)
    batch = (images.double(), labels)
    reference = copy.deepcopy(work.model).double().train()
    want = _grads_after(reference, work, batch, seed=1)
    errors: dict[str, float] = {}
    for policy in ("full", "selective"):
        model = copy.deepcopy(work.model).double().train()
        with mb.checkpoint(model, blocks="auto", policy=policy):
            errors[policy] = _relative_error(_grads_after(model, work, batch, seed=1), want)
        pairs = zip(model.buffers(), reference.buffers(), strict=True)
        errors[f"{policy} buffers"] = max(((b - c).abs().max().item() for b, c in pairs), default=0.0)
    # eval(): GroupNorm is the same in both modes, and dropout / stochastic depth draw their masks
    # per call, so 1 x 4 and 2 x 2 would differ by the masks alone
    converted = mb.convert_batchnorm_to_groupnorm(copy.deepcopy(work.model)).double().eval()
    full = _grads_after(converted, work, batch, seed=2)
    converted.zero_grad(set_to_none=True)
    accumulator = mb.Accumulator(converted, torch.optim.SGD(converted.parameters(), lr=0.0), steps=2)
    torch.manual_seed(2)
    for rows in (slice(0, 2), slice(2, 4)):
        loss, items = work.loss(converted, (batch[0][rows], batch[1][rows]))
        accumulator.backward(loss, items=items)
    errors["groupnorm accumulated"] = _relative_error([p.grad for p in converted.parameters()], full)
    return errors


def _resized(batch: tuple[torch.Tensor, torch.Tensor], image: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    if images.shape[-1] == image:
        return images, labels
    images = F.interpolate(images, size=(image, image), mode="bilinear", align_corners=False)
    if labels.ndim == 3:  # segmentation masks
        labels = F.interpolate(labels[:, None].float(), size=(image, image), mode="nearest")[:, 0].long()
    return images, labels


# --------------------------------------------------------------------------------------------------
# Plans and their speed


def _sizes(size: int) -> tuple[int, ...]:
    return tuple(micro_batch_sizes(BATCH, size))


class Runner:
    """One configuration on its own model copy: a window of its micro-batches per call."""

    def __init__(self, work: mb.Workload, sizes: tuple[int, ...], policies: dict[str, str]) -> None:
        self.model = copy.deepcopy(work.model).train()
        self.handle = mb.checkpoint(self.model, policy=policies) if policies else None
        # plain SGD: no momentum buffer, no step temporaries, so at these small images the window's
        # peak is set by the activations (what the micro-batch size moves), not by the step
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.accumulator = mb.Accumulator(self.model, self.optimizer, steps=len(sizes))
        self.accumulator._warned_batchnorm = True  # said once in the section, not per runner
        self.work, self.sizes = work, sizes

    def window(self) -> float:
        began = time.perf_counter()
        for micro in self.accumulator.iterate(self.work.make_batch(size) for size in self.sizes):
            loss, items = self.work.loss(self.model, micro.batch)
            self.accumulator.backward(loss, items=items)
            if micro.is_last:
                self.accumulator.step()
        return time.perf_counter() - began

    def peak_bytes(self) -> int:
        with mb.MemoryTracker(model=self.model, optimizer=self.optimizer) as tracker:
            self.window()
        return tracker.peak_bytes


def _everything(model: Model, blocks: list[str], budget: int) -> tuple[int, ...]:
    """The largest micro-batch whose window, every block full, the profile puts within budget."""
    everything = dict.fromkeys(blocks, "full")
    best = _sizes(2)
    for size in range(2, BATCH + 1):
        if model.evaluate(_sizes(size), everything).peak_bytes <= budget:
            best = _sizes(size)
    return best


def plans_and_speed(work: mb.Workload, *, rounds: int) -> dict[str, Any]:
    began = time.perf_counter()
    # The sizes mb.plan profiles itself for a batch of 32 with min_micro_batch_size 2 (2, half, all):
    # the plan is handed this profile, so it cannot re-profile up to its choice as it does on its own,
    # and a profile of (2, 4, 8) extrapolated to 32 under-predicted swin_t's 32 x 1 trial by 19.7 MiB
    # (8 %), whose correction then ruled out every plan (measured 10.4 MiB with 32 profiled).
    profile = profile_workload(work, micro_batch_sizes=(2, BATCH // 2, BATCH), repeats=1)
    profiled = time.perf_counter() - began
    model = Model(profile)
    predicted = {size: model.evaluate(_sizes(size), {}).peak_bytes for size in (2, 3)}
    budget = (predicted[2] + predicted[3]) // 2
    # with its trial: with trial=False the no-checkpoint plan of efficientnet_b0 at 32 px came out
    # 8 x 4 (49.2 MB measured) where every block full fit only 11 x 3 (38.9 MB), over the budget
    options = {"batch": BATCH, "memory": budget, "profile": profile, "min_micro_batch_size": 2}
    # no checkpointing: micro-batches of 2, the largest the budget admits by its construction (not
    # mb.plan(policies=["none"], profile=...): with a profile given, plan ignores policies)
    blocks = [segment.name for segment in profile.blocks]
    configurations = {
        "none": (_sizes(2), {}),
        "everything": (_everything(model, blocks, budget), dict.fromkeys(blocks, "full")),
    }
    try:
        chosen: mb.Plan | None = mb.plan(work, **options)
    except InfeasibleBudgetError as error:  # reported in the table as it is, the other rows still run
        chosen, plan_error = None, str(error)
    if chosen is not None:
        planned = {block: policy for block, policy in chosen.block_policies if policy != NONE}
        configurations["plan"] = (chosen.micro_batch_sizes, planned)
    runners = {label: Runner(work, sizes, policies) for label, (sizes, policies) in configurations.items()}
    peaks = {label: runner.peak_bytes() for label, runner in runners.items()}
    seconds: dict[str, list[float]] = {label: [] for label in runners}
    for round_index in range(rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
        for label in order:
            seconds[label].append(runners[label].window())
    rows = {}
    for label, (sizes, policies) in configurations.items():
        rows[label] = {
            "micro_batch_size": max(sizes),
            "steps": len(sizes),
            "checkpointed": len(policies),
            "policies": sorted(set(policies.values())),
            "predicted_peak_bytes": model.evaluate(sizes, policies).peak_bytes,
            "measured_peak_bytes": peaks[label],
            "seconds_per_step": min(seconds[label]),
        }
    if chosen is None:
        return {
            "budget_bytes": budget,
            "no_checkpoint_predicted": {str(k): v for k, v in predicted.items()},
            "profile_seconds": profiled,
            "rows": rows,
            "plan_error": plan_error,
            "plan_notes": [],
            "plan_handle": None,
            "plan_model": None,
        }
    rows["plan"]["planned_seconds"] = chosen.predicted_seconds_per_step
    return {
        "budget_bytes": budget,
        "no_checkpoint_predicted": {str(k): v for k, v in predicted.items()},
        "profile_seconds": profiled,
        "rows": rows,
        "plan_notes": [n for n in chosen.notes if "raised" in n],
        "plan_handle": runners["plan"].handle,
        "plan_model": runners["plan"].model,
    }


# --------------------------------------------------------------------------------------------------
# torch.compile


def compile_check(work: mb.Workload, plan_model: nn.Module) -> dict[str, float]:
    """One micro-batch of 2 through torch.compile(backend="aot_eager") of the plan's checkpointed
    model against the same model eager: compile seconds and the gradient's relative error."""
    batch = work.make_batch(2)
    eager = _grads_after(plan_model, work, batch, seed=3)
    eager = [g.clone() if g is not None else None for g in eager]
    compiled = torch.compile(plan_model, backend="aot_eager")
    began = time.perf_counter()
    got = _grads_after(compiled, work, batch, seed=3)
    seconds = time.perf_counter() - began
    return {"compile_seconds": seconds, "relative_error": _relative_error(got, eager)}


def run(args: argparse.Namespace, done: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every model in turn; ``done(report)`` after each (the section is rewritten as models finish)."""
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"image": args.image, "batch": BATCH, "rounds": args.rounds, "models": {}}
    report["environment"] = results.environment()
    report["versions"] = {"torch": torch.__version__, "torchvision": torchvision.__version__}
    report["load"] = {"start": _load()}  # the 1-minute load average, then after each model
    for name in args.models:
        began = time.perf_counter()
        work = make_workload(name, args.image)
        entry: dict[str, Any] = {"auto_blocks": describe_blocks(mb.find_blocks(work.model, "auto"))}
        print(f"{name}: {entry['auto_blocks']}", file=sys.stderr)
        small = args.image if name in DOWNSAMPLE_32X else args.grad_image
        entry["gradients"] = gradient_checks(work, small)
        print(f"{name}: gradients {entry['gradients']}", file=sys.stderr)
        speed = plans_and_speed(work, rounds=args.rounds)
        handle, plan_model = speed.pop("plan_handle"), speed.pop("plan_model")
        entry.update(speed)
        if name in args.compile and plan_model is not None:
            entry["compile"] = compile_check(work, plan_model)
        if handle is not None:
            handle.remove()
        entry["seconds"] = time.perf_counter() - began
        print(f"{name}: {entry['rows']} ({entry['seconds']:.0f} s)", file=sys.stderr)
        report["models"][name] = entry
        report["load"][name] = _load()
        done(report)
    return report


def _load() -> float:
    """The 1-minute load average (Linux); NaN where /proc/loadavg is not there."""
    try:
        with open("/proc/loadavg") as file:
            return float(file.read().split()[0])
    except OSError:
        return float("nan")


def _load_line(report: dict[str, Any]) -> str:
    loads = report.get("load", {})
    after = ", ".join(f"{name} {value:.1f}" for name, value in loads.items() if name != "start")
    start = loads.get("start", float("nan"))
    return f"Load average (1 min) at the start {start:.1f}; after each model: {after}."


def _row(name: str, entry: dict[str, Any]) -> list[Any]:
    rows, grads = entry["rows"], entry["gradients"]

    def config(label: str) -> str:
        row = rows[label]
        peak = format_bytes(row["measured_peak_bytes"])
        over = " (over the budget)" if row["measured_peak_bytes"] > entry["budget_bytes"] else ""
        return f"{row['micro_batch_size']} x {row['steps']}, {peak}{over}, {row['seconds_per_step']:.2f} s"

    compiled = entry.get("compile")
    if "plan" not in rows:  # mb.plan raised InfeasibleBudgetError at this budget
        error = entry.get("plan_error", "")
        return [
            name, entry["auto_blocks"],
            f"{max(grads['full'], grads['selective']):.0e} / "
            f"{max(grads['full buffers'], grads['selective buffers']):.0e}",
            f"{grads['groupnorm accumulated']:.0e}", format_bytes(entry["budget_bytes"]), config("none"),
            config("everything"), f"InfeasibleBudgetError: {error[:160]}...", "-", "not run",
        ]  # fmt: skip
    plan = rows["plan"]
    what = ", ".join(plan["policies"]) or "nothing"
    return [
        name,
        entry["auto_blocks"],
        f"{max(grads['full'], grads['selective']):.0e} / "
        f"{max(grads['full buffers'], grads['selective buffers']):.0e}",
        f"{grads['groupnorm accumulated']:.0e}",
        format_bytes(entry["budget_bytes"]),
        config("none"),
        config("everything"),
        f"{config('plan')} ({plan['checkpointed']} {what})",
        f"{rows['none']['seconds_per_step'] / plan['seconds_per_step']:.2f}x / "
        f"{rows['everything']['seconds_per_step'] / plan['seconds_per_step']:.2f}x",
        f"{compiled['compile_seconds']:.0f} s, {compiled['relative_error']:.0e}" if compiled else "not run",
    ]


def section(report: dict[str, Any]) -> str:
    headers = [
        "model",
        "auto blocks",
        "ckpt grad / buffers (f64)",
        "GN accum vs full (f64)",
        "budget",
        "no checkpointing",
        "every block full",
        "plan",
        "plan speedup vs none / everything",
        "compile aot_eager",
    ]
    rows = [_row(name, entry) for name, entry in report["models"].items()]
    notes = [f"{name}: {note}" for name, e in report["models"].items() for note in e["plan_notes"]]
    versions = report["versions"]
    return "\n".join(
        [
            f"torchvision {versions['torchvision']} models built with weights=None (nothing downloaded), "
            f"{report['image']}x{report['image']} random images, batch {report['batch']}. {DESCRIPTION} "
            f"Times: the fastest of {report['rounds']} interleaved rounds.",
            "",
            results.markdown_table(headers, rows),
            "",
            *(["Policies dropped while profiling: " + "; ".join(notes), ""] if notes else []),
            CAVEATS,
            "",
            results.environment_line(report["environment"])
            + "; the machine was shared with other jobs while this ran (several helpers' tests and "
            "benchmarks), so times are noisy; ratios come from one run. " + _load_line(report),
            "",
            f"Reproduce: `{report['command']}`, in its own venv: `{VENV}`",
        ]
    )


DESCRIPTION = " ".join(
    [
        "The budget is halfway between the planner's predicted no-checkpoint window peaks of",
        "micro-batch 2 and 3, so without checkpointing only micro-batches of 2 fit; every",
        "configuration has min_micro_batch_size 2 and trains whole windows of 32 (SGD). Cells:",
        "micro-batch x steps, measured peak (MemoryTracker, one window and step), seconds per step.",
        "Gradient columns: max relative error of parameter gradients, checkpointed (full and",
        "selective) against the plain model with BatchNorm kept (buffers: max abs difference), and",
        "the GroupNorm-converted model's 2 x 2 accumulated gradient against its full batch of 4.",
    ]
)
CAVEATS = " ".join(
    [
        "Caveats: at these small images a model whose activations are small beside its weights",
        "(vit_b_16 at 32 px: 5 tokens) does not bind the budget, and the planner may run the whole",
        "batch without checkpointing; the speedups against 'every block full' below 1x are the",
        "planner's choices measured as they are (its prediction from a one-round profile on a",
        "shared machine). A measured peak above the budget is marked; a plan cell that names",
        "InfeasibleBudgetError is mb.plan refusing at this budget (its trial measured more than",
        "predicted and the correction left no plan), reported as it is. compile: seconds of the",
        "first compiled micro-batch and the gradient's relative error against eager, float32; only",
        "for the models listed in --compile.",
    ]
)
VENV = (
    "python -m venv /work/venv-tv && /work/venv-tv/bin/pip install torch==2.14.1 torchvision==0.29.1 "
    "timm matplotlib && /work/venv-tv/bin/pip install --no-deps -e ."
)
DEFAULT_MODELS = (
    "resnet50,convnext_tiny,efficientnet_b0,vit_b_16,swin_t,deeplabv3_mobilenet_v3_large,deeplabv3_resnet50"
)
DEFAULT_COMPILE = "efficientnet_b0,resnet50,vit_b_16"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, default {DEFAULT_MODELS}")
    parser.add_argument("--image", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    parser.add_argument("--grad-image", type=int, default=16, help="image side of the float64 checks")
    parser.add_argument("--compile", default=DEFAULT_COMPILE, help=f"models to compile ({DEFAULT_COMPILE})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="resnet50 and efficientnet_b0, one round")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if torchvision is None:  # no markdown: microbatch bench writes no section and reports no error
        why = "needs torchvision (not installable beside torch 2.13): run it in its own venv (docstring)"
        print(json.dumps({"title": SECTION_TITLE, "skipped": why}) if args.json else why)
        return 0
    if args.quick:
        args.models, args.rounds, args.compile = "resnet50,efficientnet_b0", 1, ""
    args.models = [m for m in args.models.split(",") if m]
    args.compile = [m for m in args.compile.split(",") if m]
    rest = [arg for arg in (sys.argv[1:] if argv is None else list(argv)) if arg != "--json"]
    command = " ".join([sys.executable, "benchmarks/vision_real.py", *rest])

    def done(report: dict[str, Any]) -> None:
        report["command"] = command
        if not (args.json or args.no_write):
            results.write_section(SECTION_TITLE, section(report))

    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = run(args, done)
    return results.emit(SECTION_TITLE, section(report), report, json_mode=args.json, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
