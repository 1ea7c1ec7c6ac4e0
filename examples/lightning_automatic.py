"""Exact gradient accumulation with Lightning's automatic optimization and ``accumulate_grad_batches``.

    pip install microbatch lightning
    python examples/lightning_automatic.py            # a second on a CPU

A next-token model on variable-length sequences: each micro-batch holds a different number of
tokens, and the epoch's last window is short. Plain ``accumulate_grad_batches=k`` averages the
micro-batches' mean losses (each divided by k); with ``microbatch.lightning.ExactAccumulation`` the
step is the full window's gradient: ``training_step`` returns its mean loss and the number of tokens
it averages over, and the callback weights and divides.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from microbatch.lightning import ExactAccumulation

VOCAB = 32
IGNORE = -100


class NextToken(L.LightningModule):
    def __init__(self, *, lr: float = 0.5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        logits = self.net(batch["input_ids"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)  # token mean
        return {"loss": loss, "items": int((labels != IGNORE).sum())}


def sequences(count: int = 18, *, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 17, (count,), generator=generator).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs are tokens 0..n-2, labels tokens 1..n-1; padding is ignored by the loss."""
    inputs = nn.utils.rnn.pad_sequence([r[:-1] for r in rows], batch_first=True, padding_value=0)
    labels = nn.utils.rnn.pad_sequence([r[1:] for r in rows], batch_first=True, padding_value=IGNORE)
    return {"input_ids": inputs, "labels": labels}


def main(argv: Sequence[str] | None = None) -> tuple[NextToken, L.Trainer]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=18)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="accumulate_grad_batches")
    parser.add_argument("--plain", action="store_true", help="without ExactAccumulation (inexact)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = NextToken().double()
    loader = DataLoader(sequences(args.samples), batch_size=args.micro_batch, collate_fn=collate)  # type: ignore[arg-type]
    trainer = L.Trainer(
        max_epochs=1,
        accumulate_grad_batches=args.steps,
        callbacks=[] if args.plain else [ExactAccumulation()],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    print(f"optimizer steps: {trainer.global_step}")
    return module, trainer


if __name__ == "__main__":
    main()
