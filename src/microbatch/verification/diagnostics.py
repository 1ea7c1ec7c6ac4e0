"""Why ``verify`` found a difference: randomness, item counts, BatchNorm, miscounted items, coupling.

- randomness: a model that is random in training mode (dropout) is detected by running one
  micro-batch twice under different seeds, and controlled for the comparison: dropout modules in
  eval mode, else the whole model in eval mode except BatchNorm; if neither removes it, both
  passes start from the same seed and the noise floor (two full batches, two seeds) is reported.
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
- router balance: a mixture-of-experts loss with a load-balancing term (router_balance.py).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accumulate.batchnorm import batchnorm_layers
from ..trees.batches import batch_size_of, tensors_with_paths
from ..trees.modules import modules_of_type
from ..workload import LossFn
from .passes import Compared, Difference, Pass, PerMicro, compare, run_accumulated, run_full_batch, run_loss
from .report import Diagnostic
from .router_balance import router_balance

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


def _is_random(model: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> bool:
    """Two forward passes of one micro-batch under different seeds: do the losses differ?"""
    values = []
    for offset in (0, 1):
        probe = copy.deepcopy(model)  # BatchNorm running statistics stay untouched
        torch.manual_seed(seed + 1000 + offset)
        values.append(float(run_loss(loss_fn, probe, batch)[0].detach()))
    return values[0] != values[1]


def control_randomness(model: nn.Module, loss_fn: LossFn, batch: Any, seed: int) -> tuple[str, bool]:
    """Make the comparison deterministic by changing module modes of ``model`` (a private copy).

    Returns (what was done, whether the passes are now deterministic).
    """
    if not _is_random(model, loss_fn, batch, seed):
        return "none in training mode (two forward passes under different seeds agree)", True
    dropout = [m for _, m in modules_of_type(model, nn.modules.dropout._DropoutNd) if m.training]
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


def _count_candidates(micro: list[Any]) -> dict[str, list[int]]:
    """Per-micro-batch counts a loss could average over: samples, labels != -100, mask entries."""
    candidates = {"samples": [batch_size_of(piece) for piece in micro]}
    walks = [dict(tensors_with_paths(piece)) for piece in micro]
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
            message += (
                " They follow the sample counts: have the workload's loss return the batch size as its "
                "items (loss(model, batch) -> (loss, batch size))."
            )
        elif matches:
            message += (
                f" They follow the {matches[0]}: the loss averages over those, so have the workload's loss "
                "return that count as its items (loss(model, batch) -> (loss, count); for labels: "
                "(labels != -100).sum()) and microbatch weighs each micro-batch by it."
            )
        else:
            message += (
                " Have the workload's loss return as its items the count it averages over (tokens that "
                "are not padding, ...): loss(model, batch) -> (loss, count)."
            )
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
            "relative. microbatch weighs each micro-batch by the count the workload's loss returns with "
            f"it (loss(model, batch) -> (loss, items)) and divides once by the window total: off by "
            f"{rel:.2e}, {fixed}."
        ),
        {"items": items, "naive_max_rel_diff": naive_rel, "max_rel_diff": rel},
    )


@dataclass
class Setup:
    base: nn.Module  # private copy in training mode, randomness controlled
    loss_fn: LossFn
    batch: Any
    micro: list[Any]
    seed: int
    rtol: float


def _batchnorm(setup: Setup, diff: Difference, full: Pass, accumulated: Pass) -> Diagnostic:
    names = [name for name, layer in batchnorm_layers(setup.base) if layer.training]
    frozen = copy.deepcopy(setup.base)
    for _, layer in batchnorm_layers(frozen):
        layer.eval()
    frozen_rel = compare(
        run_accumulated(frozen, setup.loss_fn, setup.micro, setup.seed).grads,
        run_full_batch(frozen, setup.loss_fn, setup.batch, setup.seed).grads,
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


def _coupled_loss(setup: Setup, full: Pass, accumulated: Pass, per_micro: PerMicro) -> Diagnostic | None:
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


def _randomness(setup: Setup, compared: Compared, *, control: str, deterministic: bool) -> Diagnostic | None:
    if deterministic:
        if control.startswith("none"):
            return None
        return Diagnostic("randomness", "info", f"the model is {control}.", {})
    noise = compare(
        run_full_batch(setup.base, setup.loss_fn, setup.batch, setup.seed + 1).grads, compared.full.grads
    )
    return Diagnostic(
        "randomness",
        "warning",
        "the model is random even in eval mode, so the comparison is noisy (each pass starts from "
        f"the same seed): two full-batch gradients under different seeds differ by "
        f"{noise.max_rel:.2e} relative, the accumulated one by "
        f"{compared.diff.max_rel:.2e}. Make the randomness depend on a mode or flag you can turn off, then "
        "verify again.",
        {"noise_max_rel_diff": noise.max_rel},
    )


def _unexplained(setup: Setup, diff: Difference) -> Diagnostic:
    return Diagnostic(
        "unexplained",
        "warning",
        f"the accumulated gradient is off by {diff.max_rel:.2e} relative (rtol {setup.rtol:.0e}) and "
        "neither BatchNorm, item counts nor randomness explains it. Check that loss(model, batch) is "
        "a mean over exactly the items it reports and that samples do not interact within a batch "
        "(batch statistics, in-batch negatives, ...).",
        {},
    )


def diagnose(setup: Setup, compared: Compared, *, control: str, deterministic: bool) -> list[Diagnostic]:
    """Explain the difference: randomness, item counts, BatchNorm, a loss that miscounts its items,
    samples coupled within a batch."""
    full, accumulated, per_micro = compared.full, compared.accumulated, compared.per_micro
    diff, naive = compared.diff, compared.naive
    diagnostics: list[Diagnostic] = []
    explained = diff.max_rel <= setup.rtol or not deterministic
    randomness = _randomness(setup, compared, control=control, deterministic=deterministic)
    if randomness is not None:
        diagnostics.append(randomness)
    steps = len(setup.micro)
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
    balance = router_balance(setup.base, diff.max_rel, setup.rtol) if steps > 1 else None
    if not explained and balance is not None:
        diagnostics.append(balance)  # a MoE router's aux loss: the batch's expert frequencies
        explained = True
    if not explained and deterministic and steps > 1:
        coupled = _coupled_loss(setup, full, accumulated, per_micro)
        if coupled is not None:
            diagnostics.append(coupled)
            explained = True
    if not explained:
        diagnostics.append(_unexplained(setup, diff))
    return diagnostics
