"""Peers: microbatch against Accelerate, Lightning and hand-written loops on the same work.

    pip install -e '.[bench]'          # accelerate, lightning, transformers
    python benchmarks/peers [--quick] [--json] [--parts correctness speed budget]

Every tool runs for real, in this one process, side by side:

1. Correctness. microbatch, Accelerate, Lightning, the HF Trainer (with a model that takes the
   window's item count, and with one that returns a mean) and a nanoGPT-style loop: the gradient
   each hands its optimizer (SGD with lr=0, so parameters never move) against the full batch's
   gradient on the same samples, in float64:
   error = max |g - g_full| / max |g_full| over all parameters. Cases: (1) equal-size
   micro-batches, sample-mean loss; (2) token-mean loss on variable-length sequences; (3) a partial
   last window (7 micro-batches, 4 per window: the last window has 3); (4) clipping to a quarter
   of the full batch's gradient norm. Dividing each micro-batch's mean by a fixed step count is
   exact in (1) and (4) only: in (2) a micro-batch with few tokens weighs as much as one with
   many, and in (3) the short window's gradient comes out scaled by 3/4.
2. Speed. Seconds per optimizer step of transformers' GPT-2 (small config, random init, nothing
   downloaded) on variable-length byte sequences: same micro-batches, AdamW, clipping at 1.0.
   Each tool's time is divided by the hand-written loop's from the same round; rounds interleave
   the tools, so machine load hits all of them alike; the ratio reported is the median over rounds.
3. A smaller memory budget. The recipe (micro-batch x steps) no longer fits, and each tool's own
   mechanism finds what does: Accelerate's find_executable_batch_size, Lightning's batch-size
   finder, transformers' gradient checkpointing of every layer, microbatch's plan. The budget is
   bytes of peak live tensor memory (microbatch.memory.MemoryTracker). A micro-batch size "runs out
   of memory" when a steady-state window of the plain loop at that size peaks above the budget under
   the tracker: the model's forward then raises the CPU allocator's own out-of-memory error, so each
   tool's OOM handling reacts as it would on a full device. microbatch's planner measures for itself.

With --json it prints the report (with its markdown section) for ``microbatch bench``.

The package: protocol.py (the shared pieces: tools, cases, gradients, step timing, workloads,
sizes), one module per peer (microbatch_peer, accelerate_peer, lightning_peer, nanogpt_peer,
hf_trainer_peer: its loop and, where it has one, its budget mechanism), loops.py (a loop by
name), the three parts (correctness.py, speed.py, budget.py with simulated_budget.py), report.py
and cli.py.
"""

from __future__ import annotations

from .cli import build_report, main
from .correctness import run_correctness
from .protocol import CASES, TOOLS

__all__ = ["CASES", "TOOLS", "build_report", "main", "run_correctness"]
