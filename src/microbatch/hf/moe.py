"""transformers mixture-of-experts models: their load-balancing loss made exact across a Trainer's window.

A transformers MoE causal LM (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, ...) with ``output_router_logits``
adds ``router_aux_loss_coef * aux`` to its loss, aux computed on the micro-batch alone. Over a window
that is not the full batch's aux (see accumulate/balance.py): measured through the Trainer on a tiny
Qwen3-MoE the router's gradient is off by 0.70 of its largest entry. ``exact_router_balance(trainer)``
(fit_trainer calls it after ``exact_loss_weighting``) replaces it with the window's:

- the model's own aux weight is set to 0, so its loss is the token loss (aux is still returned);
- when the Trainer counts a window's items (``_get_num_items_in_batch``, before the window's first
  forward) every micro-batch of the window is routed once without gradients (the routing pre-pass:
  the decoder's forward, no LM head) and the expert counts are summed over the ranks;
- each micro-batch's loss gets ``coef * W * term``, term = (T_i / T) * E * sum_e f_e * P_e^(i) with the
  window's f and T (DDP averages the W ranks' gradients, hence W).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..accumulate.balance import WindowLoadBalance
from ..errors import ConfigError
from .weighting import _base_model

logger = logging.getLogger(__name__)

__all__ = ["exact_router_balance", "moe_routing"]


def moe_routing(model: nn.Module) -> tuple[int, int, float] | None:
    """(experts, top-k, aux coefficient) of a transformers MoE whose loss adds an aux term; else None."""
    config = getattr(_base_model(model), "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not experts or not top_k or coef == 0.0:
        return None
    return int(experts), int(top_k), coef


def _route(decoder: nn.Module, batch: Mapping[str, Any], device: torch.device) -> tuple[Any, Any]:
    """The router logits of one micro-batch from the decoder's forward without gradients; its mask."""
    inputs = {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
        if key not in ("labels", "shift_labels")
    }
    with torch.no_grad():
        outputs = decoder(**inputs, output_router_logits=True, use_cache=False)
    return outputs.router_logits, inputs.get("attention_mask")


def exact_router_balance(trainer: Any) -> str | None:
    """Make the Trainer's aux loss the window's (see the module docstring); None when the model has none.

    Call after ``exact_loss_weighting(trainer)`` (it wraps what that installed). Refuses dropout in the
    model's config: the pre-pass must route exactly as the training forward does.
    """
    routing = moe_routing(trainer.model)
    if routing is None:
        return None
    experts, top_k, coef = routing
    base = _base_model(trainer.model)
    dropout = [
        name
        for name in ("attention_dropout", "hidden_dropout", "router_jitter_noise")
        if getattr(base.config, name, 0.0)
    ]
    if dropout:
        raise ConfigError(
            "the exact load-balancing loss routes each window twice, which needs a deterministic router: set "
            f"{', '.join(dropout)} to 0 in the model's config, or pass exact=False"
        )
    balance = WindowLoadBalance(num_experts=experts, top_k=top_k, coef=coef)
    base.router_aux_loss_coef = 0.0  # type: ignore[assignment]  # its own per-micro-batch aux stops counting
    decoder: nn.Module = base.get_decoder()  # type: ignore[operator]
    world_size = int(getattr(trainer.args, "world_size", 1))
    count_window_items = trainer._get_num_items_in_batch
    weighted_compute_loss = trainer.compute_loss

    def get_num_items_in_batch(batch_samples: list[Any], device: Any) -> Any:
        items = count_window_items(batch_samples, device)
        if batch_samples and base.training:
            for batch in batch_samples:
                logits, mask = _route(decoder, batch, next(base.parameters()).device)
                balance.observe(logits, attention_mask=mask)
            balance.close_window()
        return items

    def compute_loss(
        model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if num_items_in_batch is None or not model.training:
            return weighted_compute_loss(model, inputs, return_outputs=return_outputs)
        loss, outputs = weighted_compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        term = balance.term(outputs.router_logits, attention_mask=inputs.get("attention_mask"))
        loss = loss + (coef * world_size * term).to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    trainer.compute_loss = compute_loss
    trainer._get_num_items_in_batch = get_num_items_in_batch
    note = (
        f"microbatch computes the router's load-balancing loss (coef {coef}) over each window's "
        f"{experts}-expert routing on every rank, from a routing pre-pass (a forward without gradients per "
        "micro-batch), not per micro-batch"
    )
    logger.warning("fit_trainer: %s", note)
    return note
