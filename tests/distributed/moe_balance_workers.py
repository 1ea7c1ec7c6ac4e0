"""What each rank runs in the 2-rank load-balancing test: one window of uneven micro-batches of the
tiny float64 MoE (tests/moe_balance_cases.py) through DDP and the Accumulator, with the aux term in
each of three forms; the gradient the optimizer sees (lr 0 keeps the weights)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import microbatch as mb
import moe_balance_cases as c
from microbatch import distributed
from microbatch.accumulate.balance import WindowLoadBalance, aux_with_frequencies, micro_batch_aux

# Rows per micro-batch on each rank: one window of three micro-batches, uneven within and across ranks.
SIZES = [[3, 1, 4], [2, 5, 1]]


def window(rank: int) -> list[dict[str, torch.Tensor]]:
    return [c.micro_batch(100 * rank + i, rows) for i, rows in enumerate(SIZES[rank])]


def _aux(form: str, balance: WindowLoadBalance, so_far: WindowLoadBalance, logits: Any, mask: Any) -> Any:
    if form == "micro-batch":
        return micro_batch_aux(logits, num_experts=c.EXPERTS, top_k=c.TOP_K, attention_mask=mask)
    # "so far": Qiu et al.'s global batch under accumulation, f summed over ranks and the micro-batches so far
    so_far.observe(logits, attention_mask=mask)
    counts = torch.tensor(distributed.all_reduce_values(so_far._counts.tolist()), dtype=torch.float64)
    frequencies = counts / (counts.sum() / c.TOP_K)
    return aux_with_frequencies(logits, frequencies, attention_mask=mask)


def one_window(form: str) -> dict[str, torch.Tensor]:
    inner = c.model()
    model = nn.parallel.DistributedDataParallel(inner)  # every expert gets tokens on this data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    captured: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: captured.append(c.grads_of(inner)))
    acc = mb.Accumulator(model, optimizer, steps=len(SIZES[0]))
    balance = WindowLoadBalance(num_experts=c.EXPERTS, top_k=c.TOP_K, coef=c.COEF)
    so_far = WindowLoadBalance(num_experts=c.EXPERTS, top_k=c.TOP_K)
    batches = window(dist.get_rank())
    if form == "window":
        c.prepass(inner, balance, batches)
    for micro in acc.iterate(batches):
        loss, items, logits = c.forward(model, micro.batch)
        mask = micro.batch["attention_mask"]
        if form == "window":
            loss = balance.loss(loss, items=items, router_logits=logits, attention_mask=mask)
        else:
            loss = loss + c.COEF * _aux(form, balance, so_far, logits, mask)
        acc.backward(loss, items=items)
        if micro.is_last:
            acc.step()
    return captured[0]


def all_forms() -> dict[str, Any]:
    return {form: one_window(form) for form in ("window", "micro-batch", "so far")}
