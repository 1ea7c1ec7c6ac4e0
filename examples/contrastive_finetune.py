"""Contrastive fine-tuning of a small text encoder at batch 256 on the memory of batch 16.

    pip install -e '.[hf]'                                  # from the microbatch checkout
    python examples/contrastive_finetune.py                 # a minute or so on a CPU
    python examples/contrastive_finetune.py --batch 512 --steps 20

The encoder is a BERT-style transformers model (``microbatch.hf.tiny_bert``: random weights, the
same code takes ``BertModel.from_pretrained(...)``), mean-pooled over the attention mask. The task is
next-span retrieval on the Python standard library's source (nothing downloaded): each pair is a
span of bytes and the span that follows it, and the loss is symmetric InfoNCE with a learned
temperature, in which every pair is told apart from the batch's other 2 (B - 1) spans. The batch is
the recipe here: accumulating micro-batches of 16 would give each span 15 negatives instead of 255
and another gradient, whatever the normalisation.

The budget defaults to the peak of one plain training step at batch 16 (measured). ``plan_cached``
picks the encode micro-batch size whose cached_backward fits it (proved by one real step), and each
optimizer step then applies the gradient of the whole batch of 256, exactly, through an
Accumulator (clipping once per step).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from microbatch import hf
from microbatch.models.corpus import load_corpus


class SpanPairs:
    """Pairs (span, the span after it) of ``length`` bytes from the standard library's source."""

    def __init__(self, *, length: int, seed: int) -> None:
        self.length = length
        self.documents = [d for d in load_corpus(max_bytes=300_000).train if len(d) > 2 * length]
        self.random = random.Random(seed)

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        anchors, positives = [], []
        for _ in range(batch_size):
            document = self.random.choice(self.documents)
            start = self.random.randrange(len(document) - 2 * self.length)
            anchors.append(list(document[start : start + self.length]))
            positives.append(list(document[start + self.length : start + 2 * self.length]))
        return {"anchor": torch.tensor(anchors), "positive": torch.tensor(positives)}


class SpanEncoder(nn.Module):
    """A BERT encoder, mean-pooled; one tower shared by both sides of a pair."""

    def __init__(self, *, length: int) -> None:
        super().__init__()
        self.bert = hf.tiny_bert(num_layers=2, hidden_size=64, num_heads=4, max_length=length, seed=0).bert

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=tokens).last_hidden_state
        return hidden.mean(dim=1)

    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch["anchor"]), self(batch["positive"])


class InfoNCE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, representations: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        anchor, positive = (F.normalize(r, dim=-1) for r in representations)
        logits = self.log_scale.exp().clamp(max=100) * anchor @ positive.T
        target = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def plain_step_peak_bytes(model: nn.Module, encoder: SpanEncoder, loss: InfoNCE, batch: dict) -> int:
    """Peak live bytes of one plain training step (gradients allocated) on ``batch``."""
    loss(encoder.encode(batch)).backward()
    with mb.MemoryTracker("cpu", model=model) as tracker:
        loss(encoder.encode(batch)).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def main(argv: Sequence[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256, help="pairs per optimizer step (default 256)")
    parser.add_argument(
        "--fits", type=int, default=16, help="budget: what one plain step at this batch needs"
    )
    parser.add_argument("--length", type=int, default=32, help="bytes per span (default 32)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    encoder, loss = SpanEncoder(length=args.length), InfoNCE()
    model = nn.ModuleDict({"encoder": encoder, "loss": loss})
    data = SpanPairs(length=args.length, seed=0)
    budget = plain_step_peak_bytes(model, encoder, loss, data(args.fits))
    print(f"budget: {mb.format_bytes(budget)}, the peak of one plain step at batch {args.fits}")

    plan = mb.plan_cached(encoder.encode, loss, data, batch=args.batch, memory=budget, model=model)
    print(plan)
    print()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    acc = mb.Accumulator(model, optimizer, steps=1, max_grad_norm=1.0)
    held_out = SpanPairs(length=args.length, seed=1)(args.batch)

    def held_out_loss() -> float:
        with torch.no_grad():
            return float(loss(encoder.encode(held_out)))

    before = held_out_loss()
    for step in range(args.steps):
        batch = data(args.batch)
        mb.cached_backward(
            encoder.encode, batch, loss, micro_batch_size=plan.micro_batch_size, accumulator=acc
        )
        stats = acc.step()
        print(f"step {step}: batch loss {stats.loss:.4f}, grad norm {stats.grad_norm:.3f}")
    after = held_out_loss()
    chance = math.log(args.batch)
    print(f"held-out InfoNCE at batch {args.batch}: {before:.4f} -> {after:.4f} (chance: {chance:.4f})")
    return before, after


if __name__ == "__main__":
    main()
