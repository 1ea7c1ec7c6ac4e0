"""A nanoGPT-style loop: each micro-batch's mean loss divided by the step count."""

from __future__ import annotations

from typing import Any

from torch import nn


def loop_nanogpt(model: Any, optimizer: Any, micro_batches: list[Any], **kw: Any) -> None:
    steps = kw["steps"]  # nanoGPT's train.py: every window has `steps` micro-batches; it samples forever
    for start in range(0, len(micro_batches) - steps + 1, steps):
        for batch in micro_batches[start : start + steps]:
            (kw["loss"](model, batch)[0] / steps).backward()
        if kw["max_grad_norm"] is not None:
            nn.utils.clip_grad_norm_(model.parameters(), kw["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
