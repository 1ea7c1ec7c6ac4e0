"""What each rank runs in the 2-rank Lightning test: Trainer(strategy="ddp", devices=2,
accumulate_grad_batches=3) with ExactAccumulation on this rank's own variable-length sequences (rank 0
long, rank 1 short), recording the gradient each optimizer step sees."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MICRO, ACCUMULATE = 4, 3
SAMPLES = 14  # per rank: a window of 12 and the epoch's short last window of 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_automatic.py"
# Rank 0's sequences are long, rank 1's short: their token counts differ about fivefold.
LENGTHS = [(20, 30), (3, 6)]


def example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_automatic", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_sequences(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    low, high = LENGTHS[rank]
    lengths = torch.randint(low, high, (SAMPLES,), generator=generator).tolist()
    return [torch.randint(0, example().VOCAB, (n,), generator=generator) for n in lengths]


def windows(rank: int) -> list[list[torch.Tensor]]:
    rows = rank_sequences(rank)
    size = MICRO * ACCUMULATE
    return [rows[start : start + size] for start in range(0, SAMPLES, size)]


def train(exact: bool) -> dict[str, Any]:
    import lightning as L

    from microbatch.lightning import ExactAccumulation

    ex = example()
    grads: list[dict[str, torch.Tensor]] = []

    class Recorder(L.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    torch.manual_seed(0)
    module = ex.NextToken(lr=0.0).double()  # lr 0: every window's gradient is at the initial weights
    loader = torch.utils.data.DataLoader(
        rank_sequences(dist.get_rank()), batch_size=MICRO, collate_fn=ex.collate
    )
    callbacks = [ExactAccumulation(), Recorder()] if exact else [Recorder()]
    trainer = L.Trainer(
        max_epochs=1, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, accelerator="cpu", devices=2,
        strategy="ddp", use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader)
    return {"world_size": trainer.world_size, "steps": trainer.global_step, "grads": grads}


def both() -> list[dict[str, Any]]:
    return [train(exact=True), train(exact=False)]
