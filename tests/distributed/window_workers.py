"""What each rank runs in the pipeline window tests: the losses users write, frozen layers, tied weights.

The model is pipeline_workers' tiny float64 GPT (token embedding tied to the output head). Two loss
forms a user writes, neither of which survives a micro-batch without items:

- ``masked_mean``: ``(per_token * mask).sum() / mask.sum()``, 0/0 = NaN with no counted token;
- ``ce_mean``: ``F.cross_entropy(..., ignore_index=-100)`` (mean reduction), NaN with none either.

Windows hold a number of micro-batches that the pipeline's m may or may not divide, so the
pipeline fills the last step with micro-batches of padding alone.
"""

from __future__ import annotations

from typing import Any

import pipeline_workers as pw
import torch
import torch.nn.functional as F

from microbatch.distributed.pipeline import Pipeline
from microbatch.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
IGNORE = -100
# Frozen: one block on each stage of a 2-stage cut (blocks.2 begins stage 1) and the final norm.
FROZEN = ("blocks.0.", "blocks.3.", "ln_f.")


def masked_mean(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = (labels != IGNORE).to(logits.dtype)
    safe = labels.clamp(min=0)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), safe.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum() / mask.sum(), mask.sum()


def ce_mean(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE)
    return loss, (flat != IGNORE).sum()


LOSSES = {"masked_mean": masked_mean, "ce_mean": ce_mean}


def make_model(frozen: bool) -> torch.nn.Module:
    model = pw.make_model()
    if frozen:
        for name, parameter in model.named_parameters():
            if name.startswith(FROZEN):
                parameter.requires_grad_(False)
    return model


def reference(batches: list[Batch], loss: str, frozen: bool) -> tuple[dict[str, torch.Tensor | None], float]:
    """The single-process float64 full-batch gradient (None for frozen parameters) and mean loss."""
    model = make_model(frozen)
    tokens = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    value, _ = LOSSES[loss](model(tokens), labels)
    value.backward()
    grads = {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    return grads, float(value.detach())


def build(loss: str, frozen: bool, m: int, schedule: str = "1f1b") -> Pipeline:
    return Pipeline(
        make_model(frozen),
        num_stages=2,
        micro_batches=m,
        example=torch.zeros(pw.ROWS, pw.LENGTH, dtype=torch.long),
        loss_fn=LOSSES[loss],
        schedule=schedule,  # type: ignore[arg-type]
    )


def run_windows(loss: str, frozen: bool, m: int, sizes: list[int], seed: int = 0) -> dict[str, Any]:
    """Windows of ``sizes[i]`` micro-batches (AdamW at lr 0: the weights stay); every window's
    gradients by name (None where there is none), stats and trained parameter names."""
    pipe = build(loss, frozen, m)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.0, weight_decay=0.1)
    rows = [1 + (i % pw.ROWS) for i in range(sum(sizes))]
    data = pw.micro_batches(seed, rows)
    captured, stats, start = [], [], 0
    for size in sizes:
        window = data[start : start + size]
        start += size
        stat = pipe.backward(window)
        grads = {
            name: None if p.grad is None else p.grad.detach().clone() for name, p in pipe.named_weights()
        }
        captured.append(grads)
        stats.append(stat.to_dict())
        pipe.step(optimizer)
    return {
        "grads": captured,
        "stats": stats,
        "trained": [name for name, _ in pipe.named_parameters()],
        "rows": rows,
    }


def frozen_under_weight_decay(m: int) -> dict[str, Any]:
    """AdamW with weight decay over pipe.parameters() for two windows: what moved, by name."""
    pipe = build("masked_mean", True, m)
    before = {name: p.detach().clone() for name, p in pipe.named_weights()}
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.5)
    data = pw.micro_batches(3, [3, 2, 1, 3, 2])
    for window in (data[:3], data[3:]):
        pipe.backward(window)
        pipe.step(optimizer)
    moved = {name: float((p.detach() - before[name]).abs().max()) for name, p in pipe.named_weights()}
    return {"moved": moved, "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups)}


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except ConfigError as error:
        return str(error)
    return None


def one_window(m: int) -> dict[str, Any]:
    """Done-when 1: masked mean and cross_entropy over windows m does not divide, frozen layers."""
    result: dict[str, Any] = {}
    for loss in LOSSES:
        result[loss] = run_windows(loss, True, m, [3, 5])
    result["weight_decay"] = frozen_under_weight_decay(m)
    return result


# ---------------------------------------------------------------------- property runs, shape agreement

PROPERTY_SIZES = [2, 3, 4, 5, 6, 1]  # micro-batches per window: m = 2 divides 2, 4, 6; 1 to 3 steps


def property_runs(m: int) -> dict[str, Any]:
    """Every loss form, with and without frozen layers, over windows m does and does not divide."""
    return {
        f"{loss}-{'frozen' if frozen else 'all'}": run_windows(loss, frozen, m, PROPERTY_SIZES, seed=7)
        for loss in LOSSES
        for frozen in (False, True)
    }


def shape_error_on_one_replica(m: int) -> dict[str, Any]:
    """2 replicas x 2 stages: replica 1's window has a micro-batch padded to a longer row (as a collator
    padding each batch to its longest row makes); every rank must raise, then the next window runs."""
    import torch.distributed as dist

    pipe = build("masked_mean", True, m)
    replica = pipe.layout.replica_index
    window = pw.micro_batches(replica, [3, 2, 1])
    if replica == 1:
        tokens, labels = window[1]
        window[1] = (F.pad(tokens, (0, 1)), F.pad(labels, (0, 1), value=IGNORE))
    error = error_of(lambda: pipe.backward(window))
    good = pw.micro_batches(10 + replica, [3, 2, 1])
    stats = pipe.backward(good)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)
    pipe.step(optimizer)
    dist.barrier()
    return {"error": error, "stats": stats.to_dict(), "replica": replica}
