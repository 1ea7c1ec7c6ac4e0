"""A mixture-of-experts router's load-balancing loss over the whole window: exact under accumulation.

The Switch / Mixtral / Qwen-MoE auxiliary loss (transformers' ``load_balancing_loss_func``) over a
batch of T tokens (the attention mask's ones) routed by L MoE layers of E experts, top-k each:

    aux = E * sum_e f_e * P_e
    f_e = sum_l sum_t [e in topk(z_lt)] / (L * T)      (piecewise constant: no gradient)
    P_e = sum_l sum_t softmax(z_lt)_e   / (L * T)

f is a statistic of the batch, like BatchNorm's mean: the mean of the micro-batches' aux losses is not
the batch's, and neither is its gradient. Given f, aux is linear in the probabilities: with micro-batch
i (on any rank) holding T_i tokens, P_e = sum_i (T_i / T) * P_e^(i), so

    aux = sum_i (T_i / T) * E * sum_e f_e * P_e^(i)                 (f: the whole window's)

and the sum of the micro-batches' terms has exactly the full batch's value and gradient. The catch
is that f is known only after the window's last micro-batch is routed, while the backwards run one
micro-batch at a time. ``WindowLoadBalance`` therefore takes a routing pre-pass: before the window's
first backward, ``observe()`` each micro-batch's router logits from a forward without gradients (it
must route exactly as the training forward will: the same model, no dropout), then ``close_window()``
sums the counts over the data-parallel ranks (one all_reduce of E + 2 numbers). Its cost is a forward
without autograd up to the last router per micro-batch: 0.37 - 0.39 of the window's forward and
backward on a tiny float32 Qwen3-MoE on one CPU thread (benchmarks/moe_balance.py; a shared machine).

``loss(token_loss, items=n, router_logits=...)`` returns the micro-batch loss to give
``Accumulator.backward(..., items=n)``: the Accumulator weighs it by n / N (N: the window's items over
all ranks, counted in the pre-pass), so the aux term is divided by n / N here and the window's
gradient is that of mean token loss + coef * aux over the full batch. The approximations the field
uses are kept for measuring them: ``micro_batch_aux`` (each micro-batch's own f, as transformers
computes it) and f summed over the micro-batches routed so far (Qiu et al., "Demons in the Detail",
ACL 2025, synchronise f across ranks and micro-batches as they come: ``frequencies_so_far``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import distributed
from ..errors import ConfigError, UsageError

__all__ = ["WindowLoadBalance", "aux_with_frequencies", "micro_batch_aux", "routing_counts"]


def _flat_mask(attention_mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(rows, dtype=torch.float64, device=device)
    mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float64)
    if mask.numel() != rows:
        raise ConfigError(
            f"attention_mask has {mask.numel()} tokens but the router logits have {rows} rows; pass the "
            "micro-batch's own attention_mask (batch x sequence)"
        )
    return mask


def _check_logits(router_logits: Sequence[torch.Tensor], num_experts: int) -> None:
    if isinstance(router_logits, torch.Tensor) or len(router_logits) == 0:
        raise ConfigError(
            "router_logits must be a sequence with one (tokens x experts) tensor per MoE layer, as "
            "transformers returns with output_router_logits=True"
        )
    for layer in router_logits:
        if layer.shape[-1] != num_experts:
            raise ConfigError(
                f"router logits have {layer.shape[-1]} experts but num_experts={num_experts}; pass the "
                "model's config.num_experts (or num_local_experts)"
            )


def routing_counts(
    router_logits: Sequence[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """(tokens routed to each expert summed over layers, float64; the micro-batch's tokens T_i)."""
    _check_logits(router_logits, num_experts)
    with torch.no_grad():
        device = router_logits[0].device
        mask = _flat_mask(attention_mask, router_logits[0].reshape(-1, num_experts).shape[0], device)
        counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
        for layer in router_logits:
            chosen = torch.topk(layer.reshape(-1, num_experts).softmax(-1), top_k, dim=-1).indices
            counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        return counts, float(mask.sum())


def _probability_sums(
    router_logits: Sequence[torch.Tensor], num_experts: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """(sum over layers and tokens of the router's probabilities, float64, with gradient; T_i)."""
    _check_logits(router_logits, num_experts)
    first = router_logits[0].reshape(-1, num_experts)
    mask = _flat_mask(attention_mask, first.shape[0], first.device)
    sums = sum(
        (
            (layer.reshape(-1, num_experts).to(torch.float64).softmax(-1) * mask[:, None]).sum(0)
            for layer in router_logits
        ),
        torch.zeros(num_experts, dtype=torch.float64, device=first.device),
    )
    return sums, float(mask.sum())


def micro_batch_aux(
    router_logits: Sequence[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The aux loss of one batch with its own f (transformers' formula, in float64)."""
    counts, tokens = routing_counts(
        router_logits, num_experts=num_experts, top_k=top_k, attention_mask=attention_mask
    )
    sums, _ = _probability_sums(router_logits, num_experts, attention_mask)
    rows = len(router_logits) * tokens
    return num_experts * ((counts / rows) * (sums / rows)).sum()


def aux_with_frequencies(
    router_logits: Sequence[torch.Tensor],
    frequencies: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """E * sum_e f_e * P_e over one micro-batch's own tokens, with f given (the field's approximations)."""
    sums, tokens = _probability_sums(router_logits, len(frequencies), attention_mask)
    return len(frequencies) * (frequencies.to(sums.device) * sums).sum() / (len(router_logits) * tokens)


class WindowLoadBalance:
    """The window's load-balancing loss, exact over micro-batches and ranks (see the module docstring).

    Per window: ``observe()`` every micro-batch's routing (no gradient), ``close_window()`` (every rank,
    it all-reduces), then ``loss()`` (or ``term()``) for each micro-batch's training forward. ``coef`` is
    the aux loss's weight (transformers' ``router_aux_loss_coef``).
    """

    def __init__(self, *, num_experts: int, top_k: int, coef: float = 1.0) -> None:
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ConfigError(f"need 1 <= top_k <= num_experts; got num_experts={num_experts}, top_k={top_k}")
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self._counts = torch.zeros(num_experts, dtype=torch.float64)
        self._tokens = 0.0
        self._items = 0.0
        self._closed = False
        self.micro_batches_observed = 0

    def observe(
        self,
        router_logits: Sequence[torch.Tensor],
        *,
        attention_mask: torch.Tensor | None = None,
        items: float | torch.Tensor = 0.0,
    ) -> None:
        """Add one micro-batch's routing (and its ``items``, the token loss's count) to the window's."""
        if self._closed:  # the previous window's counts: a new window starts
            self._counts.zero_()
            self._tokens, self._items, self._closed, self.micro_batches_observed = 0.0, 0.0, False, 0
        counts, tokens = routing_counts(
            router_logits, num_experts=self.num_experts, top_k=self.top_k, attention_mask=attention_mask
        )
        self._counts += counts.cpu()
        self._tokens += tokens
        self._items += float(items)
        self.micro_batches_observed += 1

    def close_window(self) -> None:
        """Sum the window's counts over the data-parallel ranks: every rank calls it, at the same point."""
        if self.micro_batches_observed == 0 or self._closed:
            raise UsageError("close_window() needs observe() of the window's micro-batches first")
        summed = distributed.all_reduce_values([*self._counts.tolist(), self._tokens, self._items])
        self._counts = torch.tensor(summed[:-2], dtype=torch.float64)
        self._tokens, self._items = summed[-2], summed[-1]
        self._closed = True

    @property
    def frequencies(self) -> torch.Tensor:
        """f_e of the window (over every rank once closed), float64."""
        layers_tokens = self._counts.sum() / self.top_k  # L * T: each routed token picks top_k experts
        return self._counts / layers_tokens.clamp(min=1.0)

    @property
    def window_items(self) -> float:
        """N: the items the token loss averages over in the whole window (all ranks)."""
        return self._items

    def term(
        self,
        router_logits: Sequence[torch.Tensor],
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(T_i / T) * E * sum_e f_e * P_e^(i): this micro-batch's part of the window's aux (no coef)."""
        if not self._closed:
            raise UsageError("term() before close_window(): the window's expert frequencies are unknown")
        sums, _ = _probability_sums(router_logits, self.num_experts, attention_mask)
        # (T_i / T) * P_e^(i) = sums_e / (L * T): only the window's T remains.
        weighted = (self.frequencies.to(sums.device) * sums).sum()
        return self.num_experts * weighted / (len(router_logits) * self._tokens)

    def loss(
        self,
        token_loss: torch.Tensor,
        *,
        items: float | torch.Tensor,
        router_logits: Sequence[torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``token_loss + coef * term * N / items``: for ``Accumulator.backward(loss, items=items)``."""
        count = float(items)
        if count <= 0:
            raise ConfigError(
                "WindowLoadBalance.loss needs items > 0 (the Accumulator weighs the loss by them); add a "
                "micro-batch with no items' term() to another micro-batch's loss instead"
            )
        aux = self.term(router_logits, attention_mask=attention_mask)
        return token_loss + (self.coef * aux * (self._items / count)).to(token_loss.dtype)

    def frequencies_so_far(self) -> torch.Tensor:
        """f over the micro-batches observed so far on this rank (the 'synchronised so far' form)."""
        return self._counts / (self._counts.sum() / self.top_k).clamp(min=1.0)
