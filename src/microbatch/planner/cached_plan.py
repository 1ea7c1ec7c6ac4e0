"""Planning gradient caching: the encode micro-batch size that fits a memory budget, and its cost.

``cached_backward`` holds, besides the parameters and their gradients (W), at its peak either

    loss phase      L(B): the representations of the whole batch, the loss's intermediates (its
                    B x B similarity matrix) and the representations' gradient, or
    encode phase    2 R(B) + A(m): the representations and their gradient (R(B) = B x bytes per
                    sample) and one micro-batch's encode activations, forward and backward.

so peak(m, B) = W + max(L(B), 2 R(B) + A(m)). A(m) = a0 + a1 m and L(B) = c0 + c1 B + c2 B^2 are
fitted to MemoryTracker measurements at small sizes; the largest m whose predicted peak fits is
chosen and proved by one real cached_backward of the whole batch under the tracker (halving m while
it does not fit). The price is one more forward pass per sample: the predicted step time is
ceil(B / m) x (forward(m) + forward-and-backward(m)).

Token budget (``tokens=True``, rows of varying length): the batch's rows are read by their attention
mask and put longest first, so the probes A(m) are measured on the longest rows (m rows padded to the
longest length L); the plan carries ``max_tokens = m x L`` and its trial runs
``cached_backward(max_tokens=m x L)``. A mini-batch of r rows padded to T <= L with r T <= m L holds no
more encode activations than the probe's, per token or quadratic in T (r T^2 <= m L T <= m L^2).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .. import distributed
from ..accumulate.cached import _flatten, cached_backward
from ..accumulate.cached_tokens import row_lengths
from ..errors import ConfigError, InfeasibleBudgetError
from ..memory import MemoryTracker, format_bytes, parse_bytes
from ..trees.batches import batch_size_of, map_tensors, slice_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedPlan:
    """The encode micro-batch size of ``cached_backward`` for a batch and a memory budget."""

    batch: int
    micro_batch_size: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None  # one real cached_backward of the whole batch (None: no trial)
    weights_bytes: int  # parameters + gradients
    representation_bytes: int  # R(B): the cache of the whole batch's representations
    loss_phase_bytes: int  # L(B): representations, the loss's intermediates (B x B) and their gradient
    encode_phase_bytes: int  # 2 R(B) + A(m)
    full_batch_peak_bytes: int  # predicted for the whole batch at once, without caching
    seconds_per_step: float  # predicted, cached
    full_batch_seconds_per_step: float  # predicted, whole batch at once
    extra_forward_fraction: float  # the cost of caching: time of the extra forward passes / plain step
    caching: bool = True  # False: the whole batch fits at once, the plain step is the plan
    max_tokens: int | None = None  # tokens=True: micro_batch_size x longest_tokens, for cached_backward
    longest_tokens: int | None = None  # tokens=True: the longest row of the planned batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.max_tokens is None:
            return self._rows_text()
        return (
            f"{self._rows_text()}\n  token budget: max_tokens={self.max_tokens} padded tokens per encode "
            f"pass ({self.micro_batch_size} rows x the longest, {self.longest_tokens} tokens)"
        )

    def _rows_text(self) -> str:
        measured = f", measured {format_bytes(self.measured_peak_bytes)}" if self.measured_peak_bytes else ""
        if not self.caching:
            return "\n".join(
                [
                    f"no gradient caching needed: batch {self.batch} fits whole in the budget "
                    f"{format_bytes(self.budget_bytes)}",
                    f"  peak {format_bytes(self.predicted_peak_bytes)} predicted{measured} for the plain "
                    "step loss(encode(batch)).backward(), at its own speed "
                    f"({self.seconds_per_step:.3g} s/step; caching would add one forward per sample)",
                ]
            )
        return "\n".join(
            [
                f"cached_backward: batch {self.batch} encoded in micro-batches of {self.micro_batch_size} "
                f"(budget {format_bytes(self.budget_bytes)})",
                f"  peak {format_bytes(self.predicted_peak_bytes)} predicted{measured}: weights "
                f"{format_bytes(self.weights_bytes)} + max(loss phase {format_bytes(self.loss_phase_bytes)}, "
                f"encode phase {format_bytes(self.encode_phase_bytes)}); representation cache "
                f"{format_bytes(self.representation_bytes)}",
                f"  whole batch at once: {format_bytes(self.full_batch_peak_bytes)}",
                f"  cost: one more forward per sample, +{self.extra_forward_fraction:.0%} time "
                f"({self.seconds_per_step:.3g} s/step vs {self.full_batch_seconds_per_step:.3g})",
            ]
        )


def _above_weights(run: Callable[[], Any], model: torch.nn.Module | None) -> tuple[int, int]:
    """(peak bytes above parameters + gradients, parameters + gradients) of ``run``, gradients allocated."""
    run()  # allocate the gradients first: every step after the first has them
    with MemoryTracker("cpu" if model is None else _device(model), model=model) as tracker:
        run()
    weights = tracker.breakdown["parameters"] + tracker.breakdown["gradients"]
    return tracker.peak_bytes - weights, weights


def _device(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _fit(xs: list[float], ys: list[float], degree: int) -> list[float]:
    """Least-squares polynomial coefficients (lowest power first), non-negative."""
    a = torch.tensor([[x**k for k in range(degree + 1)] for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    coefficients = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
    return [max(float(c), 0.0) for c in coefficients]


def _poly(coefficients: list[float], x: float) -> int:
    return math.ceil(sum(c * x**k for k, c in enumerate(coefficients)))


def _seconds(run: Callable[[], Any], repeats: int = 3) -> float:
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


@dataclass(frozen=True)
class _Measured:
    encode: list[float]  # A(m) = a0 + a1 m
    loss: list[float]  # L(B) = c0 + c1 B + c2 B^2
    representation_bytes_per_sample: int
    weights_bytes: int
    forward_seconds_per_sample: float
    step_seconds_per_sample: float  # forward + backward


def _backward_all(tensors: list[torch.Tensor]) -> None:
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _encode_step(encode: Callable[[Any], Any], micro: Any) -> Callable[[], None]:
    rows = batch_size_of(micro)
    return lambda: _backward_all(_flatten(encode(micro), rows=rows, where="encode")[1])


def _measure(
    encode: Callable[[Any], Any], loss: Callable[[Any], torch.Tensor], batch: Any, model: Any
) -> _Measured:
    from ..accumulate.cached import _unflatten

    size = batch_size_of(batch)
    # Small probes: a plan is wanted exactly when large encode passes do not fit.
    probe = max(1, min(8, size // 8))
    micro_sizes = sorted({probe, min(size, 2 * probe)})
    encode_bytes, weights = [], 0
    for m in micro_sizes:
        above, weights = _above_weights(_encode_step(encode, slice_batch(batch, 0, m)), model)
        encode_bytes.append(float(above))
    loss_sizes = sorted({max(2, size // 4), max(2, size // 2), size})
    loss_bytes, per_sample = [], 0
    for b in loss_sizes:
        with torch.no_grad():
            structure, flat = _flatten(encode(slice_batch(batch, 0, b)), rows=b, where="encode")
        per_sample = sum(t[0].numel() * t.element_size() for t in flat)

        def run(flat: list[torch.Tensor] = flat, structure: Any = structure) -> None:
            leaves = [t.detach().requires_grad_() for t in flat]
            loss(_unflatten(structure, leaves)).backward()

        loss_bytes.append(float(_above_weights(run, model)[0]))
    micro = slice_batch(batch, 0, micro_sizes[-1])
    with torch.no_grad():
        forward = _seconds(lambda: encode(micro))
    step = _seconds(_encode_step(encode, micro))
    return _Measured(
        encode=_fit([float(m) for m in micro_sizes], encode_bytes, min(1, len(micro_sizes) - 1)),
        loss=_fit([float(b) for b in loss_sizes], loss_bytes, min(2, len(loss_sizes) - 1)),
        representation_bytes_per_sample=per_sample,
        weights_bytes=weights,
        forward_seconds_per_sample=forward / micro_sizes[-1],
        step_seconds_per_sample=step / micro_sizes[-1],
    )


def _predict(measured: _Measured, batch: int, micro: int, budget: int) -> dict[str, Any]:
    representations = measured.representation_bytes_per_sample * batch
    loss_phase = _poly(measured.loss, batch)
    encode_phase = 2 * representations + _poly(measured.encode, micro)
    forward, step = measured.forward_seconds_per_sample, measured.step_seconds_per_sample
    return {
        "batch": batch,
        "micro_batch_size": micro,
        "budget_bytes": budget,
        "predicted_peak_bytes": measured.weights_bytes + max(loss_phase, encode_phase),
        "weights_bytes": measured.weights_bytes,
        "representation_bytes": representations,
        "loss_phase_bytes": loss_phase,
        "encode_phase_bytes": encode_phase,
        "full_batch_peak_bytes": measured.weights_bytes + _poly(measured.encode, batch) + loss_phase,
        "seconds_per_step": batch * (forward + step),
        "full_batch_seconds_per_step": batch * step,
        "extra_forward_fraction": forward / step if step > 0 else 0.0,
    }


@distributed.single_process()
def plan_cached(
    encode: Callable[[Any], Any],
    loss: Callable[[Any], torch.Tensor],
    make_batch: Callable[[int], Any],
    *,
    batch: int,
    memory: str | int | float,
    model: torch.nn.Module,
    trial: bool = True,
    tokens: bool = False,
) -> CachedPlan:
    """The largest encode micro-batch size for ``cached_backward(encode, make_batch(batch), loss)``
    within ``memory`` (peak live tensor bytes, as ``mb.plan``'s budget); see the module docstring.

    ``model``: the module holding the parameters of encode and loss (counted with their gradients;
    optimizer state is not part of this peak). Measures at small sizes, then (``trial``) runs one real
    cached_backward of the whole batch. Gradients, the RNG state and the model are left as found.
    Raises InfeasibleBudgetError when even micro-batches of one sample do not fit. ``tokens``: also a
    token budget ``max_tokens`` for ``cached_backward(max_tokens=)`` (module docstring; rows' lengths
    from the batch's attention mask).
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be an integer >= 1, got {batch!r}")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model must be the torch.nn.Module holding encode's parameters, got {type(model).__name__}"
        )
    budget = parse_bytes(memory, device=_device(model), name="memory")
    saved_grads = {p: p.grad for p in model.parameters()}
    devices = [_device(model)] if _device(model).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            full = make_batch(batch)
            if batch_size_of(full) != batch:
                raise ConfigError(
                    f"make_batch({batch}) returned {batch_size_of(full)} samples; it must return {batch}"
                )
            full, longest = _longest_first(full) if tokens else (full, None)
            measured = _measure(encode, loss, full, model)
            plain = _plain_step(encode, loss, full, model, measured, budget, trial)
            if plain is not None:
                return _with_tokens(plain, longest)
            fitting = _fitting_sizes(measured, batch, budget)
            if not fitting:
                smallest = _predict(measured, batch, 1, budget)
                need = format_bytes(smallest["predicted_peak_bytes"])
                raise InfeasibleBudgetError(
                    f"memory={format_bytes(budget)} is below what cached_backward needs for batch {batch} "
                    f"even with micro-batches of 1 sample ({need}); "
                    "the loss phase over the whole batch and the representation cache set this minimum",
                    minimum_bytes=smallest["predicted_peak_bytes"],
                    parts={
                        k: smallest[k] for k in ("weights_bytes", "loss_phase_bytes", "encode_phase_bytes")
                    },
                )
            return _prove(encode, loss, full, model, measured, fitting, budget, trial, longest)
    finally:
        for parameter, grad in saved_grads.items():
            parameter.grad = grad


def _fitting_sizes(measured: _Measured, batch: int, budget: int) -> list[int]:
    """Powers of two up to the batch (and the batch), largest first, predicted to fit ``budget``."""
    candidates = sorted({2**k for k in range(batch.bit_length()) if 2**k <= batch} | {batch}, reverse=True)
    return [m for m in candidates if _predict(measured, batch, m, budget)["predicted_peak_bytes"] <= budget]


def _plain_step(
    encode: Callable[[Any], Any],
    loss: Callable[[Any], torch.Tensor],
    full: Any,
    model: torch.nn.Module,
    measured: _Measured,
    budget: int,
    trial: bool,
) -> CachedPlan | None:
    """The plan without caching when the whole batch is predicted (and, with ``trial``, measured) to
    fit: the plain step has the same gradient without the extra forward. None otherwise."""
    batch = batch_size_of(full)
    predicted = _predict(measured, batch, batch, budget)
    plain_bytes = predicted["full_batch_peak_bytes"]
    if plain_bytes > budget:
        return None
    measured_bytes = None
    if trial:
        with MemoryTracker(_device(model), model=model) as tracker:
            loss(encode(full)).backward()
        if tracker.peak_bytes > budget:
            logger.info(
                "cached plan: the whole batch measured %s, over the budget", format_bytes(tracker.peak_bytes)
            )
            return None
        measured_bytes = tracker.peak_bytes
    predicted.update(
        predicted_peak_bytes=plain_bytes,
        seconds_per_step=predicted["full_batch_seconds_per_step"],
        extra_forward_fraction=0.0,
    )
    return CachedPlan(measured_peak_bytes=measured_bytes, caching=False, **predicted)


def _prove(
    encode: Callable[[Any], Any],
    loss: Callable[[Any], torch.Tensor],
    full: Any,
    model: torch.nn.Module,
    measured: _Measured,
    fitting: list[int],
    budget: int,
    trial: bool,
    longest: int | None = None,
) -> CachedPlan:
    """One real cached_backward at the chosen size; the next smaller size while it does not fit."""
    batch = batch_size_of(full)
    for micro in fitting:
        predicted = _predict(measured, batch, micro, budget)
        if not trial:
            return _with_tokens(CachedPlan(measured_peak_bytes=None, **predicted), longest)
        rows, tokens = (micro, None) if longest is None else (None, micro * longest)
        with MemoryTracker(_device(model), model=model) as tracker:
            cached_backward(encode, full, loss, micro_batch_size=rows, max_tokens=tokens)
        if tracker.peak_bytes <= budget:
            return _with_tokens(CachedPlan(measured_peak_bytes=tracker.peak_bytes, **predicted), longest)
        logger.info(
            "cached plan: micro-batch %d measured %s over the budget %s; trying a smaller one",
            micro,
            format_bytes(tracker.peak_bytes),
            format_bytes(budget),
        )
    raise InfeasibleBudgetError(
        f"memory={format_bytes(budget)}: no encode micro-batch size fits batch {batch} when measured "
        f"(the smallest tried, {fitting[-1]}, needed {format_bytes(tracker.peak_bytes)})",
        minimum_bytes=tracker.peak_bytes,
    )


def _longest_first(full: Any) -> tuple[Any, int]:
    """The batch's rows longest first (the probes take its first rows) and the longest row's tokens."""
    lengths = row_lengths(full)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    index = torch.tensor(order, dtype=torch.long)
    return map_tensors(lambda t: t.index_select(0, index.to(t.device)), full), max(lengths)


def _with_tokens(plan: CachedPlan, longest: int | None) -> CachedPlan:
    if longest is None:
        return plan
    return dataclasses.replace(plan, max_tokens=plan.micro_batch_size * longest, longest_tokens=longest)
