"""Fine-tune a tiny GPT-2 with a plan: exact token-level accumulation within a memory budget.

    pip install -e '.[hf]'                                 # from the microbatch checkout
    python examples/finetune_gpt2.py                       # a few seconds on a CPU
    python examples/finetune_gpt2.py --memory 8MiB --windows 20

The model is a transformers GPT2LMHeadModel built from a tiny configuration (random weights; the
same code takes ``GPT2LMHeadModel.from_pretrained(...)``). The data is byte-level text: chunks of
the Python standard library's source of 2 to 64 bytes, right-padded, so every micro-batch carries a
different number of tokens. Nothing is downloaded.

``plan`` measures the model and picks the micro-batch size, the number of accumulation steps and
which decoder layers to checkpoint so that one optimizer step on ``--batch`` sequences stays
within ``--memory`` of peak memory (proved by one real trial step). ``plan.apply`` checkpoints
those layers and returns an Accumulator; each micro-batch's backward is weighted by its count of
predicted tokens (``causal_lm_loss`` returns it), so every optimizer step applies the gradient of
the whole batch's token-mean loss, exactly as one step on the full batch would.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

import microbatch as mb
from microbatch import hf


def main(argv: Sequence[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32, help="sequences per optimizer step (default 32)")
    parser.add_argument("--memory", default="12MiB", help="peak memory budget (default 12MiB)")
    parser.add_argument("--windows", type=int, default=10, help="optimizer steps to train (default 10)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    args = parser.parse_args(argv)

    model = hf.tiny_gpt2(num_layers=4, hidden_size=64, num_heads=4, max_length=64, seed=0)
    workload = hf.causal_lm_workload(
        model, hf.StdlibTextBatches(max_length=64, seed=0), name="tiny-gpt2-finetune"
    )
    # Clipping is a plan input: the plan's trial clips as training will, and apply() sets it.
    the_plan = mb.plan(
        workload, batch=args.batch, memory=args.memory, max_profile_micro_batch_size=8, max_grad_norm=1.0
    )
    print(the_plan)
    print()

    held_out = hf.StdlibTextBatches(max_length=64, seed=1)(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    accumulator = the_plan.apply(model, optimizer)

    def evaluate() -> float:
        with torch.no_grad():
            loss, _ = hf.causal_lm_loss(model, held_out)
        return float(loss)

    losses = [evaluate()]
    print(f"held-out loss before: {losses[0]:.4f} nats per byte")
    for _ in range(args.windows):
        batch = workload.make_batch(args.batch)
        for micro in accumulator.iterate(the_plan.split(batch)):
            loss, items = hf.causal_lm_loss(model, micro.batch)
            accumulator.backward(loss, items=items)
            if micro.is_last:
                print(accumulator.step())
    losses.append(evaluate())
    print(f"held-out loss after {args.windows} steps: {losses[-1]:.4f} nats per byte")
    return losses


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    main()
