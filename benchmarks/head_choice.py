"""The loss head as a plan choice on a real tiny Llama with a large vocabulary (issue 34, done when 2).

A transformers LlamaForCausalLM (vocabulary 32,000, width 64, one layer, 256 tokens a sample) at a
300 MB budget, where a sample's float32 logits (31 MiB) outweigh its weights: the plan with the head
as a choice (head=[256, 1024]) against the best plan without it (head=[]), both taking the largest
micro-batch that fits. Each plan's window (batch 16) then runs ROUNDS times, the two alternating in
one process, under MemoryTracker; the JSON gives micro-batch sizes, measured peaks and samples/s
(the fastest window of each).

    PYTHONPATH=src python benchmarks/head_choice.py
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

import microbatch as mb
from microbatch import hf
from microbatch.memory import MemoryTracker
from microbatch.profile.runs import train_window

BATCH, BUDGET_BYTES, ROUNDS = 16, 300 * 10**6, 3


def _workload() -> mb.Workload:
    torch.manual_seed(0)
    model = hf.tiny_llama(vocab_size=32000, hidden_size=64, num_layers=1, max_length=257)
    return hf.causal_lm_workload(model, hf.StdlibTextBatches(max_length=257, seed=0), name="llama-32k")


def main() -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    for name, head in (("without head choice (head=[])", []), ("with head choice", [256, 1024])):
        workload = _workload()
        plan = mb.plan(
            workload,
            batch=BATCH,
            memory=BUDGET_BYTES,
            head=head,
            policies=["full"],
            max_profile_micro_batch_size=4,
            prefer_large_micro_batches=True,
        )
        accumulator = plan.apply(workload.model, workload.make_optimizer())
        runs[name] = {
            "plan": plan,
            "workload": workload,
            "accumulator": accumulator,
            "seconds": [],
            "peaks": [],
        }
    for _ in range(ROUNDS):
        for run in runs.values():  # alternating: the machine's load falls on both alike
            workload, plan = run["workload"], run["plan"]
            batch = workload.make_batch(BATCH)
            optimizer = run["accumulator"].optimizer
            with MemoryTracker("cpu", model=workload.model, optimizer=optimizer) as tracker:
                began = time.perf_counter()
                train_window(workload, run["accumulator"], plan.split(batch))
                run["seconds"].append(time.perf_counter() - began)
            run["peaks"].append(tracker.peak_bytes)
    rows = {}
    for name, run in runs.items():
        plan = run["plan"]
        rows[name] = {
            "micro_batch_size": plan.micro_batch_size,
            "steps": plan.steps,
            "head_chunk_tokens": plan.head_chunk_tokens,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes_per_window": run["peaks"],
            "within_budget": all(peak <= BUDGET_BYTES for peak in run["peaks"]),
            "samples_per_second": BATCH / min(run["seconds"]),
        }
    return {"budget_bytes": BUDGET_BYTES, "batch": BATCH, "rounds": ROUNDS, "plans": rows}


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
