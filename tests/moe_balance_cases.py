"""A tiny float64 mixture-of-experts LM, uneven micro-batches of padded token rows, and the full-batch
reference of token mean + coef * load-balancing aux (tests/test_moe_balance.py and the 2-rank test)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from microbatch.accumulate.balance import WindowLoadBalance, micro_batch_aux

VOCAB, EXPERTS, TOP_K, COEF = 64, 8, 2, 0.01


class MoEOutput(NamedTuple):  # a tuple, so DDP can find the tensors in it
    logits: torch.Tensor
    router_logits: tuple[torch.Tensor, ...]


class TinyMoE(nn.Module):
    """Embedding, two top-k routed mixture-of-experts MLP layers (residual), LM head; float64 throughout.

    transformers' MoE models round to float32 inside (RMSNorm, the router's softmax), so a micro-batch
    weighted at another scale than the full batch's (the Accumulator's items / R) differs from it by
    ~1e-7 even without an aux loss (measured 9.3e-8 on the tiny Qwen3-MoE); this model keeps the
    comparison float64 throughout for rtol 1e-9. It returns router logits as transformers does.
    """

    def __init__(self, width: int = 16, hidden: int = 24, layers: int = 2) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, width)
            self.routers = nn.ModuleList(nn.Linear(width, EXPERTS, bias=False) for _ in range(layers))
            self.up = nn.ParameterList(
                nn.Parameter(torch.randn(EXPERTS, width, hidden) / width**0.5) for _ in range(layers)
            )
            self.down = nn.ParameterList(
                nn.Parameter(torch.randn(EXPERTS, hidden, width) / hidden**0.5) for _ in range(layers)
            )
            self.head = nn.Linear(width, VOCAB)
        self.double()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        x = self.embed(input_ids).reshape(-1, self.embed.embedding_dim)
        router_logits = []
        for router, up, down in zip(self.routers, self.up, self.down, strict=True):
            logits = router(x)
            router_logits.append(logits)
            weights, chosen = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
            mixed = torch.zeros_like(x)
            for expert in range(EXPERTS):  # the eager expert loop: each expert on the tokens routed to it
                rows, slot = torch.where(chosen == expert)
                out = torch.tanh(x[rows] @ up[expert]) @ down[expert]
                mixed = mixed.index_add(0, rows, out * weights[rows, slot, None])
            x = x + mixed
        logits = self.head(x).reshape(*input_ids.shape, VOCAB)
        return MoEOutput(logits, tuple(router_logits))


def model() -> nn.Module:
    return TinyMoE()


def micro_batch(seed: int, rows: int) -> dict[str, torch.Tensor]:
    """``rows`` right-padded sequences of 3 to 12 tokens; labels -100 on padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (rows,), generator=generator)
    width = int(lengths.max())
    ids = torch.randint(3, VOCAB, (rows, width), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def collate(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return {
        "input_ids": torch.cat([pad(b["input_ids"], 0) for b in batches]),
        "attention_mask": torch.cat([pad(b["attention_mask"], 0) for b in batches]),
        "labels": torch.cat([pad(b["labels"], -100) for b in batches]),
    }


def forward(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(float64 mean cross-entropy over shifted labels, their count, the router logits)."""
    out = module(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
    )
    labels = batch["labels"][:, 1:]
    loss = nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, (labels != -100).sum(), out.router_logits


def full_batch_gradient(module: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss, _, logits = forward(module, batch)
    aux = micro_batch_aux(logits, num_experts=EXPERTS, top_k=TOP_K, attention_mask=batch["attention_mask"])
    (loss + COEF * aux).backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def prepass(module: nn.Module, balance: WindowLoadBalance, window: list[dict[str, torch.Tensor]]) -> None:
    """The routing pre-pass: every micro-batch of the window routed without gradients, then summed."""
    with torch.no_grad():
        for batch in window:
            _, items, logits = forward(module, batch)
            balance.observe(logits, attention_mask=batch["attention_mask"], items=items)
    balance.close_window()


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| over max |want|, over every parameter (zeros where one side has no gradient)."""
    names = set(got) | set(want)
    zero = {n: torch.zeros_like(got.get(n) if n in got else want[n]) for n in names}
    diff = max(float((got.get(n, zero[n]) - want.get(n, zero[n])).abs().max()) for n in names)
    return diff / max(float(w.abs().max()) for w in want.values())
