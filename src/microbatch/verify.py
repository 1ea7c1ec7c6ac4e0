"""Prove, for a user's own model and loss, that accumulation gives the full-batch gradient.

From the same parameters, one batch of B samples is run three ways:

    full batch          loss(model, batch).backward()              the reference G
    microbatch          Accumulator: sum_i(items_i * g_i) / T      what microbatch computes
    divide by steps     sum_i(g_i) / N                             the usual recipe (seed documents)

where g_i is the gradient of micro-batch i's mean loss, items_i its item count and T = sum_i items_i.
For a mean loss over independent items, G = sum_i (items_i / T) g_i exactly, so microbatch must
match G up to rounding; the usual recipe matches only when every micro-batch carries as many items.

Differences are reported per parameter as max|a - G| and max|a - G| / max|G| (relative to the
parameter's largest gradient entry, so entries near zero do not blow it up), and overall.

Diagnostics explain a difference instead of just reporting it:
- item counts: micro-batches with different item counts (tokens) make the usual recipe wrong;
  both errors are reported, with how microbatch fixes it (``items=``).
- items mismatch: the full-batch gradient is fitted as sum_i w_i g_i by least squares. If the fit
  is exact but w_i != items_i / T, the loss averages over something other than the items it
  reports (say tokens, while it reports samples); the fitted weights are shown and matched against
  counts found in the batch (labels != -100, mask entries).
- BatchNorm: each micro-batch is normalised with its own statistics. The comparison is repeated
  with the BatchNorm layers frozen (eval mode); the difference that goes away is BatchNorm's.
- coupled: the item-weighted mean of the micro-batch losses differs from the full batch's loss
  though the item counts agree: the samples interact (a contrastive loss; see cached_backward).
- randomness: a model that is random in training mode (dropout) is detected by running one
  micro-batch twice under different seeds, and controlled for the comparison: dropout modules in
  eval mode, else the whole model in eval mode except BatchNorm; if neither removes it, both
  passes start from the same seed and the noise floor (two full batches, two seeds) is reported.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .accumulate import Accumulator
from .batching import batch_size_of, move_batch, split_batch
from .batchnorm import batchnorm_layers
from .errors import ConfigError, WorkloadError
from .workload import LossFn, Workload

logger = logging.getLogger(__name__)

# Largest storage for the per-micro-batch gradients kept for the least-squares fit (float64).
FIT_MAX_BYTES = 256 * 2**20
# Default relative tolerance (max|a - G| / max|G|) per dtype: well above rounding, far below the
# differences a real mistake causes (1e-3 and up).
DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}
IGNORE_INDEX = -100

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ParameterDifference:
    """Accumulated vs full-batch gradient of one parameter."""

    name: str
    shape: tuple[int, ...]
    reference_max_abs: float  # max |G|
    max_abs_diff: float  # max |a - G|
    max_rel_diff: float  # max |a - G| / max |G|

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Diagnostic:
    """One finding: ``kind`` is batchnorm, item-counts, items-mismatch, randomness, coupled or unexplained."""

    kind: str
    severity: str  # "info" or "warning"
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"[{self.severity}] {self.kind}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found. ``equivalent`` is True when max_rel_diff <= rtol."""

    workload: str
    batch: int
    steps: int
    micro_batch_sizes: tuple[int, ...]
    items: tuple[int, ...]  # per micro-batch, as the loss reported them
    dtype: str
    device: str
    rtol: float
    equivalent: bool
    max_abs_diff: float
    max_rel_diff: float
    l2_rel_diff: float  # ||a - G|| / ||G|| over all parameters
    naive_max_abs_diff: float  # the divide-by-steps recipe
    naive_max_rel_diff: float
    full_loss: float
    accumulated_loss: float  # the Accumulator's item-weighted window loss
    naive_loss: float  # mean of the micro-batch means
    randomness_control: str
    parameters: tuple[ParameterDifference, ...]
    diagnostics: tuple[Diagnostic, ...]

    @property
    def loss_diff(self) -> float:
        return abs(self.accumulated_loss - self.full_loss)

    @property
    def naive_loss_diff(self) -> float:
        return abs(self.naive_loss - self.full_loss)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["loss_diff"] = self.loss_diff
        data["naive_loss_diff"] = self.naive_loss_diff
        return data

    def __str__(self) -> str:
        sizes = _describe_sizes(self.micro_batch_sizes)
        verdict = (
            f"EQUAL within rounding (rtol {self.rtol:.0e})"
            if self.equivalent
            else f"DIFFERENT (rtol {self.rtol:.0e})"
        )
        lines = [
            f"verify {self.workload}: batch {self.batch} as {sizes} ({self.dtype}, {self.device})",
            f"items per micro-batch: {', '.join(map(str, self.items))} ({sum(self.items)} in all)",
            "",
            f"{'gradient vs full batch':<26}{'max abs diff':>14}{'max rel diff':>14}",
            f"{'microbatch (items=)':<26}{self.max_abs_diff:>14.2e}{self.max_rel_diff:>14.2e}  {verdict}",
            f"{'divide by steps':<26}{self.naive_max_abs_diff:>14.2e}{self.naive_max_rel_diff:>14.2e}",
            "",
            f"loss: full batch {self.full_loss:.8g}, microbatch {self.accumulated_loss:.8g} "
            f"(diff {self.loss_diff:.2e}), mean of micro-batch means {self.naive_loss:.8g} "
            f"(diff {self.naive_loss_diff:.2e})",
            f"randomness: {self.randomness_control}",
            "",
        ]
        lines += _parameter_table(self.parameters)
        if self.diagnostics:
            lines += ["", "diagnostics:"]
            lines += [f"  {diagnostic}" for diagnostic in self.diagnostics]
        return "\n".join(lines)


def _describe_sizes(sizes: tuple[int, ...]) -> str:
    if len(set(sizes)) == 1:
        return f"{len(sizes)} micro-batch{'es' if len(sizes) > 1 else ''} of {sizes[0]}"
    return f"{len(sizes)} micro-batches of {', '.join(map(str, sizes))}"


def _parameter_table(parameters: tuple[ParameterDifference, ...], *, limit: int = 20) -> list[str]:
    shown = list(parameters)
    hidden = 0
    if len(shown) > limit:  # keep the largest differences, in model order
        worst = sorted(shown, key=lambda p: p.max_rel_diff, reverse=True)[: limit // 2]
        keep = {p.name for p in worst}
        hidden = len(shown) - len(keep)
        shown = [p for p in shown if p.name in keep]
    width = max([9, *(len(p.name) for p in shown)]) + 2
    lines = [
        f"{'parameter':<{width}}{'shape':<16}{'max|full grad|':>15}{'max abs diff':>14}{'max rel diff':>14}"
    ]
    for p in shown:
        shape = "(" + ", ".join(map(str, p.shape)) + ("," if len(p.shape) == 1 else "") + ")"
        lines.append(
            f"{p.name:<{width}}{shape:<16}{p.reference_max_abs:>15.3e}{p.max_abs_diff:>14.2e}"
            f"{p.max_rel_diff:>14.2e}"
        )
    if hidden:
        lines.append(f"... {hidden} more parameters with smaller differences (--json lists all)")
    return lines


# ---------------------------------------------------------------------- passes


def _cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _cast_floating(v, dtype) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_cast_floating(v, dtype) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cast_floating(v, dtype) for v in batch)
    return batch


def _run_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    result = loss_fn(model, batch)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise WorkloadError("the workload's loss(model, batch) must return a pair (loss, items)")
    loss, items = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise WorkloadError(
            "the workload's loss must be a scalar tensor that requires grad (a mean over the batch's "
            f"items), got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
        )
    count = float(items.item()) if isinstance(items, torch.Tensor) else float(items)
    if not (count > 0 and count == int(count)):
        raise WorkloadError(f"the workload's loss reported items={count:g}; items must be a whole count > 0")
    return loss, int(count)


def _grads(model: nn.Module) -> Grads:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}


@dataclass
class _Pass:
    grads: Grads
    loss: float
    buffers: dict[str, torch.Tensor]
    loss_dtype: torch.dtype = torch.float32
    items: int = 0  # the full batch's item count, as its loss reported it


def _full_batch(base: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> _Pass:
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    loss, items = _run_loss(loss_fn, model, batch)
    loss.backward()
    grads = _grads(model)
    if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
        raise WorkloadError("the full-batch gradient is not finite (inf or nan); fix the loss, then verify")
    return _Pass(grads, float(loss.detach()), _float_buffers(model), loss.dtype, items)


def _accumulated(base: nn.Module, loss_fn: LossFn, micro: list[Any], seed: int) -> _Pass:
    """The Accumulator's window gradient, captured just before its (lr=0) optimizer step."""
    model = copy.deepcopy(base)
    captured: Grads = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(lambda *_: captured.update(_grads(model)))
    acc = Accumulator(model, optimizer, steps=len(micro))
    torch.manual_seed(seed)
    window_loss = math.nan
    for m in acc.iterate(micro):
        loss, items = _run_loss(loss_fn, model, m.batch)
        acc.backward(loss, items=items)
        if m.is_last:
            window_loss = acc.step().loss
    if not captured:  # the Accumulator skipped its step: the gradient was not finite
        raise WorkloadError("the accumulated gradient is not finite (inf or nan); fix the loss, then verify")
    return _Pass(captured, window_loss, _float_buffers(model))


@dataclass
class _PerMicro:
    naive: _Pass
    items: list[int]
    columns: list[torch.Tensor] | None  # flattened float64 g_i, when small enough to keep


def _per_micro_batch(
    base: nn.Module, loss_fn: LossFn, micro: list[Any], seed: int, *, keep_columns: bool
) -> _PerMicro:
    """Each micro-batch's own gradient g_i; their mean is the divide-by-steps recipe."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    naive: Grads | None = None
    losses, items, columns = [], [], []
    for piece in micro:
        model.zero_grad(set_to_none=True)
        loss, count = _run_loss(loss_fn, model, piece)
        loss.backward()
        grads = _grads(model)
        losses.append(float(loss.detach()))
        items.append(count)
        if keep_columns:
            columns.append(torch.cat([g.detach().double().flatten().cpu() for g in grads.values()]))
        if naive is None:
            naive = {name: g / len(micro) for name, g in grads.items()}
        else:
            for name, g in grads.items():
                naive[name] += g / len(micro)
    naive_pass = _Pass(naive or {}, sum(losses) / len(losses), _float_buffers(model))
    return _PerMicro(naive_pass, items, columns if keep_columns else None)


@dataclass
class _Difference:
    max_abs: float
    max_rel: float
    l2_rel: float
    per_parameter: tuple[ParameterDifference, ...]


def _compare(actual: Grads, expected: Grads) -> _Difference:
    rows, diff_sq, ref_sq = [], 0.0, 0.0
    overall_abs, overall_ref = 0.0, 0.0
    for name, reference in expected.items():
        ref = reference.double()
        diff = (actual[name].double() - ref).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        rows.append(ParameterDifference(name, tuple(ref.shape), ref_max, max_abs, _ratio(max_abs, ref_max)))
        overall_abs, overall_ref = max(overall_abs, max_abs), max(overall_ref, ref_max)
        diff_sq += float(diff.pow(2).sum())
        ref_sq += float(ref.pow(2).sum())
    return _Difference(
        overall_abs,
        _ratio(overall_abs, overall_ref),
        _ratio(math.sqrt(diff_sq), math.sqrt(ref_sq)),
        tuple(rows),
    )


def _ratio(numerator: float, denominator: float) -> float:
    if denominator > 0:
        return numerator / denominator
    return 0.0 if numerator == 0 else math.inf


# ---------------------------------------------------------------------- randomness


def _is_random(model: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> bool:
    """Two forward passes of one micro-batch under different seeds: do the losses differ?"""
    values = []
    for offset in (0, 1):
        probe = copy.deepcopy(model)  # BatchNorm running statistics stay untouched
        torch.manual_seed(seed + 1000 + offset)
        values.append(float(_run_loss(loss_fn, probe, batch)[0].detach()))
    return values[0] != values[1]


def _control_randomness(model: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> tuple[str, bool]:
    """Make the comparison deterministic by changing module modes of ``model`` (a private copy).

    Returns (what was done, whether the passes are now deterministic).
    """
    if not _is_random(model, loss_fn, batch, seed):
        return "none in training mode (two forward passes under different seeds agree)", True
    dropout = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for module in dropout:
        module.eval()
    if dropout and not _is_random(model, loss_fn, batch, seed):
        return (
            f"random in training mode; {len(dropout)} dropout module(s) put in eval mode for the comparison",
            True,
        )
    training_norms = [layer for _, layer in batchnorm_layers(model) if layer.training]
    model.eval()
    for layer in training_norms:
        layer.train()
    if not _is_random(model, loss_fn, batch, seed):
        return (
            "random in training mode (not only in nn.Dropout modules, e.g. functional dropout); the model "
            "was put in eval mode except its BatchNorm layers for the comparison"
        ), True
    model.train()
    return "random even in eval mode: not controlled; each pass starts from the same seed", False


# ---------------------------------------------------------------------- diagnostics


def _walk_tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _walk_tensors(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from _walk_tensors(value, f"{path}[{index}]")


def _count_candidates(micro: list[Any]) -> dict[str, list[int]]:
    """Per-micro-batch counts a loss could average over: samples, labels != -100, mask entries."""
    candidates = {"samples": [batch_size_of(piece) for piece in micro]}
    walks = [dict(_walk_tensors(piece)) for piece in micro]
    for path, tensor in walks[0].items():
        pieces = [walk.get(path) for walk in walks]
        if any(p is None for p in pieces):
            continue
        if tensor.dtype == torch.bool:
            candidates[f"True entries of {path}"] = [int(p.sum()) for p in pieces if p is not None]
        elif not tensor.is_floating_point() and not tensor.is_complex() and tensor.dim() >= 2:
            counts = [int((p != IGNORE_INDEX).sum()) for p in pieces if p is not None]
            if counts != [p.numel() for p in pieces if p is not None]:
                candidates[f"entries != {IGNORE_INDEX} of {path}"] = counts
                # Causal LMs shift inside the model: the loss averages over labels[..., 1:] (#46204).
                shifted = [int((p[..., 1:] != IGNORE_INDEX).sum()) for p in pieces if p is not None]
                candidates[f"shifted entries ({path}[..., 1:]) != {IGNORE_INDEX}"] = shifted
    return candidates


def _fit_weights(columns: list[torch.Tensor], target: torch.Tensor) -> tuple[list[float], float]:
    """Least-squares w with sum_i w_i g_i ~ G, and the relative residual ||A w - G|| / ||G||."""
    matrix = torch.stack(columns, dim=1)
    solution = torch.linalg.lstsq(matrix, target.unsqueeze(1)).solution.squeeze(1)
    residual = float((matrix @ solution - target).norm()) / max(float(target.norm()), 1e-300)
    return solution.tolist(), residual


def _items_mismatch(weights: list[float], items: list[int], micro: list[Any], rel: float) -> Diagnostic:
    total_weight = sum(weights)
    reported = [n / sum(items) for n in items]
    message = (
        f"the gradient is off by {rel:.2e}: the full-batch gradient is exactly sum_i w_i * g_i (g_i: "
        f"micro-batch i's gradient) with w = [{', '.join(f'{w:.4f}' for w in weights)}], but the items the "
        f"loss reports give w = [{', '.join(f'{w:.4f}' for w in reported)}]."
    )
    matches = []
    if abs(total_weight - 1) > 1e-3:
        message += (
            f" The weights add up to {total_weight:.4g}, not 1: the full-batch loss is not a mean (a sum?); "
            "return the mean loss and the count it averages over."
        )
    else:
        for label, counts in _count_candidates(micro).items():
            shares = [c / sum(counts) for c in counts] if sum(counts) else counts
            if max(abs(a - b) for a, b in zip(weights, shares, strict=True)) < 1e-3 * max(shares):
                matches.append(label)
        if matches and matches[0] == "samples":
            message += " They follow the sample counts: return items=batch size."
        elif matches:
            message += (
                f" They follow the {matches[0]}: the loss averages over those, so return that count as "
                "items (for labels: (labels != -100).sum()) and microbatch weighs each micro-batch by it."
            )
        else:
            message += " Return as items the count the loss averages over (tokens that are not padding, ...)."
    return Diagnostic(
        "items-mismatch",
        "warning",
        message,
        {"fitted_weights": weights, "reported_weights": reported, "matches": matches},
    )


def _item_counts(items: list[int], sizes: list[int], rel: float, naive_rel: float, rtol: float) -> Diagnostic:
    unit = "samples" if items == sizes else "items, not samples (tokens?)"
    fixed = "exact up to rounding" if rel <= rtol else "still off (see below)"
    return Diagnostic(
        "item-counts",
        "info" if rel <= rtol else "warning",
        (
            f"the loss averages over different counts per micro-batch ({unit}: {min(items)} to "
            f"{max(items)}, {sum(items)} in all). Dividing each micro-batch's mean loss by the number of "
            f"micro-batches (the usual recipe) weighs them equally: the gradient is off by {naive_rel:.2e} "
            "relative. microbatch weighs each micro-batch by its count (acc.backward(loss, items=n)) and "
            f"divides once by the window total: off by {rel:.2e}, {fixed}."
        ),
        {"items": items, "naive_max_rel_diff": naive_rel, "max_rel_diff": rel},
    )


@dataclass
class _Setup:
    base: nn.Module  # private copy in training mode, randomness controlled
    loss_fn: LossFn
    batch: Any
    micro: list[Any]
    seed: int
    rtol: float


def _batchnorm(setup: _Setup, diff: _Difference, full: _Pass, accumulated: _Pass) -> Diagnostic:
    names = [name for name, layer in batchnorm_layers(setup.base) if layer.training]
    frozen = copy.deepcopy(setup.base)
    for _, layer in batchnorm_layers(frozen):
        layer.eval()
    frozen_rel = _compare(
        _accumulated(frozen, setup.loss_fn, setup.micro, setup.seed).grads,
        _full_batch(frozen, setup.loss_fn, setup.batch, setup.seed).grads,
    ).max_rel
    running_diff = max(
        (
            float((accumulated.buffers[key] - value).abs().max())
            for key, value in full.buffers.items()
            if "running" in key and key in accumulated.buffers
        ),
        default=0.0,
    )
    sizes = "/".join(map(str, sorted({batch_size_of(piece) for piece in setup.micro})))
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    cause = "BatchNorm causes the difference" if frozen_rel <= setup.rtol else "part of it has another cause"
    message = (
        f"{len(names)} BatchNorm layer(s) in training mode ({shown}) normalise each micro-batch of {sizes} "
        f"samples with its own mean and variance, not the full batch's: the gradient differs by "
        f"{diff.max_rel:.2e} relative ({diff.max_abs:.2e} max abs). With them frozen (eval mode) the "
        f"difference is {frozen_rel:.2e}, so {cause}. Their running statistics are also updated "
        f"{len(setup.micro)} times per optimizer step instead of once (they end {running_diff:.2e} apart). "
        "What to do: larger micro-batches (fewer steps), microbatch.convert_batchnorm_to_groupnorm(model) "
        "(exact), or freeze BatchNorm (eval mode); Accumulator(correct_batchnorm_momentum=True) makes the "
        "running statistics decay once per step."
    )
    return Diagnostic(
        "batchnorm",
        "warning" if diff.max_rel > setup.rtol else "info",
        message,
        {
            "layers": names,
            "max_rel_diff": diff.max_rel,
            "max_abs_diff": diff.max_abs,
            "frozen_max_rel_diff": frozen_rel,
            "running_stats_max_abs_diff": running_diff,
        },
    )


def _coupled_loss(setup: _Setup, full: _Pass, accumulated: _Pass, per_micro: _PerMicro) -> Diagnostic | None:
    """Samples that interact within a batch: the item-weighted mean of the micro-batch losses differs
    from the full batch's loss although the item counts add up. For a loss that is a mean over
    independent items the two are equal, so the loss (or the model) couples the samples."""
    if sum(per_micro.items) != full.items or any(layer.training for _, layer in batchnorm_layers(setup.base)):
        return None
    loss_rel = abs(accumulated.loss - full.loss) / max(abs(full.loss), 1e-30)
    if not loss_rel > setup.rtol:
        return None
    return Diagnostic(
        "coupled",
        "warning",
        f"the samples interact within a batch: the item-weighted mean of the micro-batch losses is "
        f"{accumulated.loss:.8g}, the full batch's loss {full.loss:.8g} (relative difference "
        f"{loss_rel:.2e}), although the item counts agree ({full.items}). No weighting of micro-batch "
        "gradients is exact then. "
        "If the loss compares samples with each other (contrastive / InfoNCE, in-batch negatives, a batch "
        "softmax) while the model encodes each sample alone, use microbatch.cached_backward(encode, batch, "
        "loss, micro_batch_size=...): gradient caching gives the full batch's gradient exactly. If the model "
        "itself mixes samples (batch statistics), use micro-batches as large as the batch.",
        {"full_loss": full.loss, "micro_batch_weighted_loss": accumulated.loss, "loss_rel_diff": loss_rel},
    )


def _diagnose(
    setup: _Setup,
    *,
    control: str,
    deterministic: bool,
    full: _Pass,
    accumulated: _Pass,
    per_micro: _PerMicro,
    diff: _Difference,
    naive: _Difference,
) -> list[Diagnostic]:
    """Explain the difference: randomness, item counts, BatchNorm, a loss that miscounts its items."""
    diagnostics: list[Diagnostic] = []
    explained = diff.max_rel <= setup.rtol
    steps = len(setup.micro)
    if not deterministic:
        noise = _compare(
            _full_batch(setup.base, setup.loss_fn, setup.batch, setup.seed + 1).grads, full.grads
        )
        diagnostics.append(
            Diagnostic(
                "randomness",
                "warning",
                "the model is random even in eval mode, so the comparison is noisy (each pass starts from "
                f"the same seed): two full-batch gradients under different seeds differ by "
                f"{noise.max_rel:.2e} relative, the accumulated one by "
                f"{diff.max_rel:.2e}. Make the randomness depend on a mode or flag you can turn off, then "
                "verify again.",
                {"noise_max_rel_diff": noise.max_rel},
            )
        )
        explained = True
    elif not control.startswith("none"):
        diagnostics.append(Diagnostic("randomness", "info", f"the model is {control}.", {}))
    if steps > 1 and len(set(per_micro.items)) > 1:
        sizes = [batch_size_of(piece) for piece in setup.micro]
        diagnostics.append(_item_counts(per_micro.items, sizes, diff.max_rel, naive.max_rel, setup.rtol))
    if steps > 1 and any(layer.training for _, layer in batchnorm_layers(setup.base)):
        diagnostic = _batchnorm(setup, diff, full, accumulated)
        diagnostics.append(diagnostic)
        explained = explained or diagnostic.details["frozen_max_rel_diff"] <= setup.rtol
    if not explained and per_micro.columns is not None:
        target = torch.cat([g.double().flatten().cpu() for g in full.grads.values()])
        weights, residual = _fit_weights(per_micro.columns, target)
        logger.debug("least-squares micro-batch weights %s, relative residual %.2e", weights, residual)
        if residual <= max(setup.rtol, 1e-3 * diff.l2_rel):
            diagnostics.append(_items_mismatch(weights, per_micro.items, setup.micro, diff.max_rel))
            explained = True
    if not explained and deterministic and steps > 1:
        coupled = _coupled_loss(setup, full, accumulated, per_micro)
        if coupled is not None:
            diagnostics.append(coupled)
            explained = True
    if not explained:
        diagnostics.append(
            Diagnostic(
                "unexplained",
                "warning",
                f"the accumulated gradient is off by {diff.max_rel:.2e} relative (rtol {setup.rtol:.0e}) and "
                "neither BatchNorm, item counts nor randomness explains it. Check that loss(model, batch) is "
                "a mean over exactly the items it reports and that samples do not interact within a batch "
                "(batch statistics, in-batch negatives, ...).",
                {},
            )
        )
    return diagnostics


# ---------------------------------------------------------------------- verify


def _even_sizes(batch: int, steps: int) -> list[int]:
    base, extra = divmod(batch, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _check_arguments(workload: object, batch: int, steps: int, rtol: float | None) -> None:
    if not isinstance(workload, Workload):
        raise ConfigError(f"workload must be a microbatch.Workload, got {type(workload).__name__}")
    for name, value in (("batch", batch), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if steps > batch:
        raise ConfigError(f"steps ({steps}) must be <= batch ({batch}): every micro-batch needs a sample")
    if rtol is not None and not (isinstance(rtol, (int, float)) and rtol > 0 and math.isfinite(rtol)):
        raise ConfigError(f"rtol must be a positive finite number, got {rtol!r}")


def verify(
    workload: Workload,
    *,
    batch: int = 32,
    steps: int = 4,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    seed: int = 0,
) -> VerifyReport:
    """Compare microbatch's accumulated gradient with the full-batch gradient, from the same parameters.

    ``batch`` samples from one ``workload.make_batch(batch)`` call are cut into ``steps`` micro-batches
    as evenly as possible. ``dtype`` runs the comparison in another precision (float64 makes it sharp;
    the batch's floating tensors are cast too). ``rtol`` bounds max|a - G| / max|G| (default by dtype,
    see DEFAULT_RTOL). The workload's model, its modes and the global RNG are left untouched.
    """
    _check_arguments(workload, batch, steps, rtol)
    device = workload.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        base = copy.deepcopy(workload.model)
        if dtype is not None:
            base.to(dtype)
        base.train()
        parameter_dtype = next((p.dtype for p in base.parameters()), torch.float32)
        full_batch = move_batch(workload.make_batch(batch), device)
        if dtype is not None:
            full_batch = _cast_floating(full_batch, dtype)
        if batch_size_of(full_batch) != batch:
            raise WorkloadError(
                f"make_batch({batch}) returned a batch of {batch_size_of(full_batch)} samples; "
                "it must return exactly the number asked for"
            )
        sizes = _even_sizes(batch, steps)
        micro = split_batch(full_batch, sizes)
        control, deterministic = _control_randomness(base, workload.loss, micro[0], seed)
        full = _full_batch(base, workload.loss, full_batch, seed)
        if rtol is None:
            # The comparison is only as sharp as the coarser of the parameters and the loss: a model
            # may compute its loss in float32 inside a float64 model (transformers does).
            rtol = max(DEFAULT_RTOL.get(parameter_dtype, 1e-5), DEFAULT_RTOL.get(full.loss_dtype, 1e-5))
        setup = _Setup(base=base, loss_fn=workload.loss, batch=full_batch, micro=micro, seed=seed, rtol=rtol)
        num_values = sum(g.numel() for g in full.grads.values())
        # The fit means something only with many more gradient entries than micro-batches.
        keep_columns = (
            deterministic and 1 < steps <= num_values // 4 and num_values * steps * 8 <= FIT_MAX_BYTES
        )
        per_micro = _per_micro_batch(base, workload.loss, setup.micro, seed, keep_columns=keep_columns)
        accumulated = _accumulated(base, workload.loss, setup.micro, seed)
        diff = _compare(accumulated.grads, full.grads)
        naive = _compare(per_micro.naive.grads, full.grads)
        diagnostics = _diagnose(
            setup,
            control=control,
            deterministic=deterministic,
            full=full,
            accumulated=accumulated,
            per_micro=per_micro,
            diff=diff,
            naive=naive,
        )

    return VerifyReport(
        workload=workload.name,
        batch=batch,
        steps=steps,
        micro_batch_sizes=tuple(sizes),
        items=tuple(per_micro.items),
        dtype=str(parameter_dtype).removeprefix("torch."),
        device=str(device),
        rtol=setup.rtol,
        equivalent=diff.max_rel <= setup.rtol,
        max_abs_diff=diff.max_abs,
        max_rel_diff=diff.max_rel,
        l2_rel_diff=diff.l2_rel,
        naive_max_abs_diff=naive.max_abs,
        naive_max_rel_diff=naive.max_rel,
        full_loss=full.loss,
        accumulated_loss=accumulated.loss,
        naive_loss=per_micro.naive.loss,
        randomness_control=control,
        parameters=diff.per_parameter,
        diagnostics=tuple(diagnostics),
    )
