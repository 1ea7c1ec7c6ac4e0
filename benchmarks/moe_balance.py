"""The cost of the window's load-balancing loss: its routing pre-pass against the window's training.

A tiny Qwen3-MoE (4 layers, width 64, 8 experts top-2, expert width 64, float32, eager experts) on
the CPU, one thread; a window of 4 micro-batches of 4 variable-length samples (3 to 19 tokens). The
pre-pass is the decoder's forward without gradients per micro-batch (what hf/moe.py runs); the window
is each micro-batch's forward and backward. Medians of 7 rounds, after one warm-up each. A ratio of
two timings in one run; the shared CPU makes it noisy (measured 0.37).

    python benchmarks/moe_balance.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import test_hf_exact as exact
from microbatch import hf

ROUNDS = 7


def _median_seconds(run: Callable[[], None]) -> float:
    run()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    model = hf.tiny_moe("qwen3_moe", vocab_size=exact.VOCAB, num_layers=4, hidden_size=64, expert_size=64)
    dataset = exact.Examples(exact.causal_example)
    batches = [exact.collate([dataset[i] for i in range(4 * k, 4 * k + 4)]) for k in range(4)]
    decoder = model.get_decoder()

    def prepass() -> None:
        with torch.no_grad():
            for b in batches:
                decoder(
                    input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True
                )

    def window() -> None:
        for b in batches:
            model(**b).loss.backward()

    prepass_s, window_s = _median_seconds(prepass), _median_seconds(window)
    print(json.dumps({"prepass_s": prepass_s, "window_fwd_bwd_s": window_s, "ratio": prepass_s / window_s}))


if __name__ == "__main__":
    main()
