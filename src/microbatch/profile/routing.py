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

The simulation (fake tensors, profile/simulate.py) has no router values, so its routing is an explicit
input, ``moe_capacity_factor`` (1: balanced). transformers' default experts, grouped GEMMs
(``experts_implementation="grouped_mm"``: tokens sorted by expert, one GEMM per expert over its rows),
have the routed rows' shapes, tokens x top-k, whatever the routing: their memory needs no assumption
and the factor changes no size. The eager loop's shapes are the routing's: simulated, each expert
runs on a stated number of rows (``expert_rows``): the busiest takes ``moe_capacity_factor`` times its
balanced share (top_k / E of the routed rows), the others share the rest evenly, every token still
routed to top-k experts. The plan's notes say which.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

__all__ = ["expert_rows", "routing_note", "simulated_routing", "simulated_routing_note"]

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


def expert_rows(tokens: int, *, experts: int, top_k: int, capacity_factor: float = 1.0) -> list[int]:
    """Rows each expert runs on, the busiest first: ``capacity_factor`` times the balanced share
    ``tokens * top_k / experts`` (at most every token), the others sharing the rest evenly."""
    if isinstance(capacity_factor, bool) or not math.isfinite(capacity_factor) or capacity_factor < 1:
        raise ConfigError(
            f"moe_capacity_factor must be a finite number >= 1 (1: balanced routing, top_k / E of the "
            f"tokens per expert; 2: the busiest expert takes twice that), got {capacity_factor!r}"
        )
    routed = tokens * top_k
    busiest = min(tokens, math.ceil(capacity_factor * routed / experts - 1e-9))
    share, extra = divmod(routed - busiest, experts - 1)
    return [busiest] + [share + (index < extra) for index in range(experts - 1)]


def _eager_loops(model: nn.Module) -> list[nn.Module]:
    """transformers' experts modules that run its eager loop in the plain layout (gate and up stacked,
    no bias, no post-expert norm): the loop ``simulated_routing`` sizes."""
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        plain = getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
        plain = (
            plain and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
        )
        plain = plain and not getattr(module, "has_post_expert_norm", True)
        weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
        stacked = all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
        if plain and stacked and getattr(config, "_experts_implementation", None) == "eager":
            found.append(module)
    return found


def _sized_loop(module: nn.Module, capacity_factor: float) -> Callable[..., torch.Tensor]:
    """transformers' eager expert loop, op for op, each expert on the rows ``expert_rows`` states
    (indices of those sizes in place of ``torch.where`` on the routing mask)."""
    experts = int(module.num_experts)  # type: ignore[arg-type]

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():  # the routing mask and the experts hit, as the loop builds them
            mask = F.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
            torch.greater(mask.sum(dim=(-1, -2)), 0)
        rows_by_expert = expert_rows(
            int(hidden_states.shape[0]), experts=experts, top_k=int(top_k_index.shape[-1]),
            capacity_factor=capacity_factor,
        )  # fmt: skip
        for expert, rows in enumerate(rows_by_expert):
            if rows == 0:
                continue
            token_idx = torch.zeros(rows, dtype=torch.long, device=hidden_states.device)
            top_k_pos = torch.zeros(rows, dtype=torch.long, device=hidden_states.device)
            gate_up = F.linear(hidden_states[token_idx], module.gate_up_proj[expert])  # type: ignore[index]
            gate, up = gate_up.chunk(2, dim=-1)
            current = F.linear(module.act_fn(gate) * up, module.down_proj[expert])  # type: ignore[operator, index]
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        return final

    return forward


@contextlib.contextmanager
def simulated_routing(model: nn.Module, capacity_factor: float = 1.0) -> Iterator[None]:
    """For the ``with`` block, each eager expert loop of ``model`` runs on the rows ``expert_rows``
    states (fake tensors cannot size ``torch.where`` on a routing mask); grouped GEMMs run as they are."""
    expert_rows(8, experts=8, top_k=1, capacity_factor=capacity_factor)  # refuses a bad factor up front
    loops = _eager_loops(model)
    for module in loops:
        module.forward = _sized_loop(module, capacity_factor)
    try:
        yield
    finally:
        for module in loops:
            del module.forward


def simulated_routing_note(model: nn.Module, capacity_factor: float = 1.0) -> str | None:
    """The plan's note on the routing a simulated mixture of experts assumed; None for a dense model."""
    shape = _moe_shape(model)
    if shape is None:
        return None
    experts, top_k = shape
    head = f"mixture of experts ({experts} experts, top-{top_k}), simulated"
    factor = f"moe_capacity_factor {capacity_factor:g}"
    if not _eager_loops(model):
        return (
            f"{head} as grouped GEMMs: every expert tensor is the routed rows, tokens x top-{top_k}, "
            f"whatever the routing, so the memory holds for any routing ({factor} sizes no tensor "
            "here; it sizes transformers' eager expert loop); the grouped GEMMs are priced at the "
            "dense matmul rate, as a balanced routing runs them"
        )
    share = f"{top_k}/{experts} of the tokens"
    if capacity_factor == 1:
        return f"{head} under balanced routing ({factor}): each expert takes {share}"
    return (
        f"{head} with the busiest expert taking {capacity_factor:g} x its balanced share of {share} "
        f"({factor}), the other experts sharing the rest evenly"
    )
