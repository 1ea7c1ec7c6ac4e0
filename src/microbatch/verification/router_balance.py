"""A mixture-of-experts router's load-balancing loss: a statistic of the batch, not of each sample.

transformers' MoE models (``output_router_logits`` with ``router_aux_loss_coef`` > 0) add
coef * E * sum_e f_e * P_e to their loss, f_e the fraction of the batch's tokens routed to expert e.
Computed per micro-batch, f is the micro-batch's, so no weighting of the micro-batch gradients gives
the full batch's: ``verify`` names it and says what makes it exact (accumulate/balance.py).
"""

from __future__ import annotations

from torch import nn

from .report import Diagnostic


def moe_aux_coefficient(model: nn.Module) -> float | None:
    """The aux loss's weight when the model's loss adds a micro-batch-coupled router term, else None."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not getattr(config, "output_router_logits", False):
            continue
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        if experts and coef > 0 and getattr(module, "router_aux_loss_coef", coef) > 0:
            return coef
    return None


def router_balance(model: nn.Module, max_rel: float, rtol: float) -> Diagnostic | None:
    """The diagnostic when the model's loss holds a load-balancing term and the gradient differs."""
    coef = moe_aux_coefficient(model)
    if coef is None or not max_rel > rtol:
        return None
    return Diagnostic(
        "router_balance",
        "warning",
        f"the model's loss adds a mixture-of-experts load-balancing term (router_aux_loss_coef {coef}): the "
        "fraction of tokens routed to each expert is a statistic of the batch, so each micro-batch's term "
        f"is not part of the full batch's and the gradient differs by {max_rel:.2e} relative. What to do: "
        "with a transformers Trainer, fit_trainer (or hf.exact_router_balance after exact_loss_weighting) "
        "computes the term over each window from a routing pre-pass; in your own loop, "
        "microbatch.accumulate.WindowLoadBalance (observe each micro-batch's router logits without "
        "gradients, close_window(), then loss(...) per micro-batch) gives the full batch's gradient.",
        {"router_aux_loss_coef": coef, "max_rel_diff": max_rel},
    )
