"""A linear head and its cross entropy over chunks of tokens, as one autograd function.

``chunked_cross_entropy`` with a checkpoint per chunk (head.py) holds at most one chunk's logits,
but autograd still hands every chunk's gradient of the head's weight (vocabulary x width) to the
weight separately: under autocast each chunk makes a full-size 16-bit gradient of the weight's
16-bit copy, summed, then a float32 copy of the sum, and a weight tied to the input embedding
holds that float32 gradient through the whole backward of the blocks (autograd sums a leaf's
gradients before accumulating them). For Llama 3.2 1B (vocabulary 128,256, width 2,048) each of
these is 0.49 or 0.98 GiB, more than the chunks' logits.

``LinearCrossEntropy`` is the same loss with its gradient written out (Liger's fused linear cross
entropy). For logits z = W h + b of a chunk, the summed cross entropy's gradient is (torch's
log_softmax and nll_loss backward):

    dL/dz_t = g * (softmax(z_t) - onehot(y_t))   (0 for an ignored token t; g = dL/d(loss sum))
    dL/dW   = sum over chunks (dL/dz)^T h,  dL/db = sum_t dL/dz_t,  dL/dh = (dL/dz) W

The loss is linear in g, so forward computes each chunk's logits once, its loss and its gradients
for g = 1: dh into one (tokens x width) buffer, dW added in place into one buffer (``addmm_`` in
the compute dtype, as autograd sums the chunks' gradients of the 16-bit weight copy). Backward
only scales them by g and hands the weight its gradient once, in the weight's dtype: no logits are
recomputed, and the step's time stays that of the unchunked head. The rounding differs from
autograd's only in where g is applied (after the 16-bit cast instead of before), within the
dtype's rounding; float64 is exact up to the order of the sums. Under autocast the function casts
the weight itself (no autocast cache keeps the 16-bit copy past the forward), computes the logits
in the autocast dtype and the softmax in float32, as ``F.linear`` and ``F.cross_entropy`` do
there. The loss is the sum of the chunks' sums in chunk order, as head.py's.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["fused_linear_loss", "linear_cross_entropy_head"]


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast runs for ``tensor``'s device (or simulated on the CPU)."""
    for device_type in dict.fromkeys((tensor.device.type, "cpu")):
        if torch.is_autocast_enabled(device_type) and tensor.is_floating_point():
            return torch.get_autocast_dtype(device_type)
    return tensor.dtype


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The softmax's dtype: float32 for 16-bit logits (as under autocast), else the logits' own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def linear_cross_entropy_head(head: Any) -> TypeGuard[nn.Linear]:
    """Whether ``head`` is a plain ``nn.Linear`` over ordinary tensors (the fused backward applies)."""
    if type(head) is not nn.Linear:  # a LoRA-wrapped or otherwise changed head keeps the checkpoints
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return True
    return not isinstance(head.weight, DTensor)


class _Gradients:
    """The gradients of the loss sum (dL/d(loss sum) = 1), made chunk by chunk in forward."""

    def __init__(self, needs: tuple[bool, ...], hidden: torch.Tensor, low_weight: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:  # fmt: skip
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight = torch.zeros_like(low_weight) if needs[1] else None
        self.bias = torch.zeros_like(bias, dtype=_wide(dtype)) if needs[2] and bias is not None else None
        self.start = 0

    def add_(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, low_part: torch.Tensor,
             low_weight: torch.Tensor) -> None:  # fmt: skip
        """One chunk: dL/dz = softmax(z) - onehot(y) (0 for ignored tokens), then dh, dW, db from it."""
        scores = torch.softmax(logits, dim=-1)
        counted = targets != ignore_index
        rows = torch.arange(len(targets), device=scores.device)
        scores[rows, torch.where(counted, targets, 0)] -= 1.0
        scores.mul_(counted.unsqueeze(-1))
        grad_logits = scores.to(low_weight.dtype)  # as autograd casts the float32 gradient back
        del scores
        if self.hidden is not None:
            self.hidden[self.start : self.start + len(targets)] = grad_logits @ low_weight
        if self.weight is not None:
            self.weight.addmm_(grad_logits.t(), low_part)  # in place: one buffer for every chunk
        if self.bias is not None:
            self.bias += grad_logits.sum(0)
        self.start += len(targets)


class LinearCrossEntropy(torch.autograd.Function):
    """(sum over counted tokens of CE(W h_t + b, y_t)): see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        dtype: torch.dtype,
        track: bool,
    ) -> torch.Tensor:
        low_weight = weight.to(dtype)
        low_bias = bias.to(dtype) if bias is not None else None
        needs = tuple(track and need for need in ctx.needs_input_grad[:3])
        gradients = _Gradients(needs, hidden, low_weight, bias, dtype) if any(needs) else None
        total = hidden.new_zeros((), dtype=_wide(dtype))
        for index, (part, part_targets) in enumerate(
            zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)
        ):
            low_part = part.to(dtype)
            logits = F.linear(low_part, low_weight, low_bias).to(_wide(dtype))
            loss = F.cross_entropy(logits, part_targets, ignore_index=ignore_index, reduction="sum")
            total = loss if index == 0 else total + loss  # in chunk order, as one running sum
            if gradients is not None:
                gradients.add_(logits, part_targets, ignore_index, low_part, low_weight)
        ctx.gradients, ctx.weight_dtype = gradients, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Any, ...]:
        gradients: _Gradients | None = ctx.gradients
        if gradients is None:
            raise RuntimeError(
                "the chunked loss head's gradients were used already (backward twice through it, "
                "retain_graph=True); run its forward again"
            )
        ctx.gradients = None  # the buffers become the gradients: scaled in place, handed out once
        scale = grad_total
        grad_hidden, grad_weight, grad_bias = gradients.hidden, gradients.weight, gradients.bias
        if grad_hidden is not None:
            grad_hidden.mul_(scale)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype).mul_(scale)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype).mul_(scale)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, *, chunk_tokens: int, ignore_index: int
) -> torch.Tensor:
    """Sum of CE(head(hidden_t), targets_t) over counted t; ``hidden`` (n, H), ``targets`` (n,)."""
    dtype = _compute_dtype(head.weight)
    track = torch.is_grad_enabled()
    loss: torch.Tensor = LinearCrossEntropy.apply(
        hidden, head.weight, head.bias, targets, chunk_tokens, ignore_index, dtype, track
    )
    return loss
