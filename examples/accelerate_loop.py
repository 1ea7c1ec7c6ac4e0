"""Exact gradient accumulation in an Accelerate training loop with microbatch.

    pip install -e . accelerate                       # from the microbatch checkout
    python examples/accelerate_loop.py                # a second on a CPU
    accelerate launch examples/accelerate_loop.py     # several processes: DDP

``accelerator.prepare`` wraps the model (DistributedDataParallel when several processes run), the
optimizer and the data loader. Hand the *prepared* model and optimizer to the Accumulator: it then
skips DDP's all-reduce on every micro-batch but a window's last (``no_sync``), weights each
micro-batch by its items, and divides once by the window's total over all ranks. Leave Accelerate's
own ``gradient_accumulation_steps`` at 1 (its ``accumulate()`` divides by the step count instead).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import microbatch as mb


def data(num_samples: int = 26, *, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main(argv: Sequence[str] | None = None) -> tuple[nn.Module, list[float]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=26, help="training samples (default 26)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="micro-batches per optimizer step (default 3)")
    parser.add_argument("--cpu", action="store_true", help="force the CPU")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=args.cpu)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data(args.samples), batch_size=args.micro_batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    accumulator = mb.Accumulator(model, optimizer, steps=args.steps)
    losses = []
    for micro in accumulator.iterate(loader):  # the last window may be short: still exact
        x, y = micro.batch
        loss = F.mse_loss(model(x), y)
        accumulator.backward(loss, items=x.shape[0])
        if micro.is_last:
            losses.append(accumulator.step().loss)
    accelerator.print("window losses:", ", ".join(f"{loss:.4f}" for loss in losses))
    return accelerator.unwrap_model(model), losses


if __name__ == "__main__":
    main()
