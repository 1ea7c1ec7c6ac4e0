"""The loss head in chunks: output projection and cross entropy over c tokens at a time.

For a large vocabulary V the logits of N tokens (N x V, plus a float32 copy under mixed precision
and the gradient of each) are the largest activation of a language model: Llama 3 (V = 128,256) at
8,192 tokens holds 2 GiB of bf16 logits and 4 GiB for each float32 copy. The loss is a sum over
tokens,

    sum_t CE(W h_t, y_t) = sum_chunks sum_{t in chunk} CE(W h_t, y_t),

so it can be computed a chunk at a time: each chunk's logits are made, reduced to its loss sum and
freed; backward recomputes them one chunk at a time (a non-reentrant ``torch.utils.checkpoint`` per
chunk), so at most one chunk's logits are ever alive. The gradient is the unchunked one up to the
order of a sum (torchtitan's chunked loss, PR #996; TRL's ``chunked_nll``, PR #5575). The weighting
is untouched: the loss returned is the same sum over counted tokens divided by the same count.
A plain ``nn.Linear`` head (the usual one) takes linear_loss.py's function instead of the
checkpoints: its gradients made chunk by chunk in forward, one weight gradient for all chunks and
no recompute.

``chunk_head(model, tokens=c)`` installs it on the heads the project knows:

- a model that declares ``head_chunk_tokens`` (the built-in GPT computes its loss in forward when
  given labels, chunked when the attribute is set);
- a transformers causal LM (a ``...ForCausalLM``, also under PEFT): its forward runs the body
  (``model.base_model``) and the chunked loss on the output embeddings when it trains with labels;
  evaluation, generation and calls without labels keep the original forward and its logits.

Logits in float16 / bfloat16 are upcast to float32 per chunk before the log-softmax, as
``token_loss`` and transformers' ``ForCausalLMLoss`` do for the whole tensor.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..errors import ConfigError
from .linear_loss import fused_linear_loss, linear_cross_entropy_head

__all__ = ["HeadHandle", "chunk_head", "chunked_cross_entropy", "head_module", "head_of"]

IGNORE_INDEX = -100
# transformers config fields that change the logits after the projection (Gemma 2's soft cap,
# Cohere's and Granite's scales): the chunked loss would silently drop them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# Keyword arguments of a causal LM's forward that belong to its head, not to its body.
_CHUNK_ATTRIBUTE = "_microbatch_head_chunk_tokens"
_HEAD_ARGUMENTS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "return_dict")


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:  # fmt: skip
    logits = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # log-softmax in float32 under autocast
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of CE(head(hidden_t), targets_t) over counted t, the count), ``chunk_tokens`` at a time.

    ``hidden`` is (..., H) and ``targets`` (...) already shifted; ``head`` maps (n, H) to (n, V) logits
    (an ``nn.Linear``, a LoRA-wrapped one, any module). A plain ``nn.Linear`` makes its gradients
    chunk by chunk in forward (linear_loss.py); another head recomputes each chunk in backward.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if hidden.shape[:-1] != targets.shape:
        raise ConfigError(
            f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: the targets "
            "need one (shifted) label per hidden state"
        )
    flat_targets = targets.reshape(-1)
    if flat_targets.numel() == 0:
        raise ConfigError(f"targets {tuple(targets.shape)} hold no tokens: give the head at least one")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if linear_cross_entropy_head(head):  # one backward for all chunks: one weight gradient (linear_loss.py)
        total = fused_linear_loss(
            flat_hidden, head, flat_targets, chunk_tokens=chunk_tokens, ignore_index=ignore_index
        )
        return total, (flat_targets != ignore_index).sum()
    # split (not slicing): backward concatenates the chunks' gradients once instead of one full-size
    # zero-padded gradient per chunk.
    parts = flat_hidden.split(chunk_tokens)
    losses = [
        torch_checkpoint(_chunk_loss, head, part, part_targets, ignore_index, use_reentrant=False)
        for part, part_targets in zip(parts, flat_targets.split(chunk_tokens), strict=True)
    ]
    total = losses[0]
    for loss in losses[1:]:  # in chunk order, as one running sum
        total = total + loss
    # The count stays on the device: the Accumulator reads counts once per window.
    return total, (flat_targets != ignore_index).sum()


def _base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under DDP's / PEFT's wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()  # type: ignore[operator]
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def head_of(model: nn.Module) -> str | None:
    """Which chunked head ``model`` takes: "gpt" (declares head_chunk_tokens), "causal-lm", or None."""
    if hasattr(model, "head_chunk_tokens"):
        return "gpt"
    base = _base_causal_lm(model)
    if hasattr(base, "head_chunk_tokens"):
        return "gpt"
    outputs = getattr(base, "get_output_embeddings", None)
    body = getattr(base, "base_model", None)
    has_head = callable(outputs) and isinstance(outputs(), nn.Module)
    if has_head and isinstance(body, nn.Module) and body is not base:
        return "causal-lm"
    return None


def head_module(model: nn.Module) -> nn.Module | None:
    """The output projection ``chunk_head`` would chunk (its weight is vocabulary x width), or None."""
    kind = head_of(model)
    base = model if hasattr(model, "head_chunk_tokens") else _base_causal_lm(model)
    if kind == "gpt":
        head = getattr(base, "lm_head", None)
        return head if isinstance(head, nn.Module) else None
    if kind == "causal-lm":
        output_embeddings: Any = base.get_output_embeddings
        return output_embeddings()  # type: ignore[no-any-return]
    return None


@dataclass
class HeadHandle:
    """What ``chunk_head`` changed; ``remove()`` puts the model's head back."""

    model: nn.Module
    chunk_tokens: int
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def chunk_head(model: nn.Module, *, tokens: int) -> HeadHandle:
    """Compute ``model``'s loss head ``tokens`` tokens at a time (see the module docstring)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"chunk_head: tokens must be a positive integer, got {tokens!r}")
    kind = head_of(model)
    handle = HeadHandle(model, tokens)
    if kind == "gpt":
        target = model if hasattr(model, "head_chunk_tokens") else _base_causal_lm(model)
        before = getattr(target, "head_chunk_tokens")  # noqa: B009 - an nn.Module attribute mypy cannot see
        setattr(target, "head_chunk_tokens", tokens)  # noqa: B010
        handle._undo.append(lambda: setattr(target, "head_chunk_tokens", before))
        return handle
    if kind is None:
        raise ConfigError(
            f"chunk_head: {type(model).__name__} has no loss head microbatch can chunk; it knows the "
            "built-in GPT and transformers causal LMs (...ForCausalLM). Compute your loss with "
            "microbatch.checkpointing.chunked_cross_entropy instead"
        )
    base = _base_causal_lm(model)
    config = getattr(base, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ConfigError(
                f"chunk_head: {type(base).__name__}'s config.{name}={value!r} transforms the logits after "
                "the projection, which the chunked loss does not; plan it without the head chunks"
            )
    if "forward" in vars(base):
        raise ConfigError(f"chunk_head: {type(base).__name__}'s forward is already replaced (chunked twice?)")

    # A method bound to the instance (not a closure over it), so a deepcopy of the model chunks its
    # own head; wraps: the Trainer reads the forward's signature for its dataset columns.
    @functools.wraps(type(base).forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _chunked_causal_lm_forward(self, *args, **kwargs)

    setattr(base, _CHUNK_ATTRIBUTE, tokens)
    base.forward = types.MethodType(forward, base)

    def undo() -> None:
        delattr(base, "forward")
        delattr(base, _CHUNK_ATTRIBUTE)

    handle._undo.append(undo)
    return handle


def _chunked_causal_lm_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
    if not model.training or (labels is None and shift_labels is None) or len(args) > 1:
        return type(model).forward(model, *args, **kwargs)
    inputs = {key: value for key, value in kwargs.items() if key not in _HEAD_ARGUMENTS}
    if args:
        inputs["input_ids"] = args[0]
    body: Any = model.base_model  # the model without its head (transformers' base_model_prefix)
    outputs = body(**inputs)
    hidden = outputs[0]
    if shift_labels is None:
        if not isinstance(labels, torch.Tensor):
            raise ConfigError(
                f"labels must be a tensor of token ids for the chunked head, got {type(labels).__name__}"
            )
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # ForCausalLMLoss's shift
    output_embeddings: Any = model.get_output_embeddings  # transformers' method
    head = output_embeddings()
    tokens = getattr(model, _CHUNK_ATTRIBUTE)
    loss_sum, count = chunked_cross_entropy(hidden, head, shift_labels.to(hidden.device), chunk_tokens=tokens)
    items = kwargs.get("num_items_in_batch")
    loss = loss_sum / (count.clamp(min=1) if items is None else items)
    return _causal_lm_output(loss, outputs)


def _causal_lm_output(loss: torch.Tensor, outputs: Any) -> Any:
    """transformers' CausalLMOutputWithPast without logits (no tensor holds them all)."""
    import dataclasses

    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The body's cache, hidden states and attentions under the names this transformers uses
    # ("cache" in 5.x, "past_key_values" before).
    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} - {"loss", "logits"}
    parts = {name: getattr(outputs, name, None) for name in names}
    return CausalLMOutputWithPast(loss=loss, logits=None, **parts)
