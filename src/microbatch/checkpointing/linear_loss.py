"""A linear head and its cross entropy over chunks of tokens, as one autograd function.

``chunked_cross_entropy`` with a checkpoint per chunk (head.py) holds at most one chunk's logits,
but autograd still hands every chunk's gradient of the head's weight (vocabulary x width) to the
weight separately: under autocast each chunk makes a full-size 16-bit gradient of the weight's
16-bit copy, summed, then a float32 copy of the sum, and a weight tied to the input embedding
holds that float32 gradient through the whole backward of the blocks (autograd sums a leaf's
gradients before accumulating them). For Llama 3.2 1B (vocabulary 128,256, width 2,048) each of
these is 0.49 or 0.98 GiB, more than the chunks' logits.

``LinearCrossEntropy`` is the same loss with the backward written out. For logits z = W h + b of
a chunk, the summed cross entropy's gradient is (torch's log_softmax and nll_loss backward):

    dL/dz_t = g * (softmax(z_t) - onehot(y_t))   (0 for an ignored token t; g = dL/d(loss sum))
    dL/dW  += (dL/dz)^T h,  dL/db += sum_t dL/dz_t,  dL/dh = (dL/dz) W

so backward recomputes each chunk's logits, adds its weight gradient in place into one buffer
(``addmm_``, in the compute dtype as autograd sums the chunks' gradients of the 16-bit copy) and
returns the weight's gradient once, in the weight's dtype. Under autocast the function casts the
weight itself (no autocast cache keeps the 16-bit copy past the forward) and computes the logits
in the autocast dtype and the softmax in float32, as ``F.linear`` and ``F.cross_entropy`` do
under autocast. The loss is the sum of the chunks' sums in chunk order, as head.py's.
"""

from __future__ import annotations

from typing import Any

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


def linear_cross_entropy_head(head: Any) -> bool:
    """Whether ``head`` is a plain ``nn.Linear`` over ordinary tensors (the fused backward applies)."""
    if type(head) is not nn.Linear:  # a LoRA-wrapped or otherwise changed head keeps the checkpoints
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return True
    return not isinstance(head.weight, DTensor)


class LinearCrossEntropy(torch.autograd.Function):
    """(sum over counted tokens of CE(W h_t + b, y_t)): see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        low_weight = weight.to(dtype)
        low_bias = bias.to(dtype) if bias is not None else None
        total: torch.Tensor | None = None
        for part, part_targets in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
            logits = F.linear(part.to(dtype), low_weight, low_bias)
            loss = F.cross_entropy(logits.to(_wide(dtype)), part_targets, ignore_index=ignore_index, reduction="sum")
            total = loss if total is None else total + loss  # in chunk order, as one running sum
        del low_weight, low_bias
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_tokens, ctx.ignore_index, ctx.dtype = chunk_tokens, ignore_index, dtype
        return hidden.new_zeros((), dtype=_wide(dtype)) if total is None else total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype, tokens = ctx.dtype, ctx.chunk_tokens
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        low_weight = weight.to(dtype)
        low_bias = bias.to(dtype) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(low_weight) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=_wide(dtype)) if want_bias and bias is not None else None
        start = 0
        for part, part_targets in zip(hidden.split(tokens), targets.split(tokens), strict=True):
            low_part = part.to(dtype)
            scores = torch.softmax(F.linear(low_part, low_weight, low_bias).to(_wide(dtype)), dim=-1)
            counted = part_targets != ctx.ignore_index
            rows = torch.arange(len(part_targets), device=scores.device)
            scores[rows, torch.where(counted, part_targets, 0)] -= 1.0  # softmax - onehot
            scores.mul_((grad_total * counted).unsqueeze(-1))  # ignored tokens: no gradient
            grad_logits = scores.to(dtype)
            del scores
            if grad_hidden is not None:
                grad_hidden[start : start + len(part)] = grad_logits @ low_weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), low_part)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            start += len(part)
        del low_weight, low_bias
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, *, chunk_tokens: int, ignore_index: int
) -> torch.Tensor:
    """Sum of CE(head(hidden_t), targets_t) over counted t; ``hidden`` (n, H), ``targets`` (n,)."""
    dtype = _compute_dtype(head.weight)
    loss: torch.Tensor = LinearCrossEntropy.apply(
        hidden, head.weight, head.bias, targets, chunk_tokens, ignore_index, dtype
    )
    return loss
