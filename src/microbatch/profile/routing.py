"""The routing a mixture-of-experts profile was measured on, stated in the plan's notes.

A transformers MoE layer (Qwen3-MoE, Mixtral, ...) sends each token to its router's top-k experts and
runs every expert on the tokens routed to it (``nonzero`` on the routing mask), so its memory depends on
the routing, not on the batch's shape alone: how many experts are hit (backward turns each hit expert's
index into the stacked weights into a zero-filled gradient of the whole stack, summed into the weight's:
one Qwen3-MoE expert block at 128 tokens peaks at 1.81 MB with 8 experts hit, 1.38 MB with 2, its
stacked weights 0.39 MB) and how many tokens the busiest expert takes. The profile runs the workload's
batches through the model's routers as they are, so the plan holds for that routing. Measured on tiny
Qwen3-MoE and Mixtral configs (8 experts, top-2, expert width 128, 128 to 512 tokens a micro-batch,
tests/test_hf_moe_peak.py): profiled on its own routing the plan is within 1.4 % of the tracker,
balanced or collapsed; a plan profiled under a balanced router was up to 11 % over a collapsed router's
peak, and one profiled under a collapsed router up to 10 % under a balanced router's.
"""

from __future__ import annotations

from torch import nn

__all__ = ["routing_note"]

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _moe_shape(model: nn.Module) -> tuple[int, int] | None:
    """(experts, top-k) from a transformers model's config when it is a mixture of experts; else None."""
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = next((getattr(config, key) for key in _EXPERT_COUNTS if getattr(config, key, None)), None)
    if not isinstance(top_k, int) or not isinstance(experts, int) or top_k < 1 or experts <= top_k:
        return None
    return experts, top_k


def routing_note(model: nn.Module) -> str | None:
    """The plan's note on the routing its profile assumed, for a mixture of experts; else None."""
    shape = _moe_shape(model)
    if shape is None:
        return None
    experts, top_k = shape
    return (
        f"mixture of experts ({experts} experts, top-{top_k}): the peak was measured on the routing of the "
        "profiled batches through the routers as they are now (balanced: each expert takes about "
        f"{top_k}/{experts} of the tokens); the expert loop's memory follows the routing (experts hit, the "
        "busiest expert's tokens), and on tiny Qwen3-MoE / Mixtral another routing moved the peak by up to "
        "11 %: profile on batches and router weights routed as training will route them"
    )
