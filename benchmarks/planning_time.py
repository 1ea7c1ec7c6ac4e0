"""Planning time of the README's main job, one plan per process, for side-by-side comparisons.

``microbatch train`` with no arguments plans gpt-mini at batch 64 within the CPU's default 96 MiB
less the window's inputs (training/run_plan.planned), with clipping at 1.0 as its loop runs. This
makes that plan once, from scratch, and prints one JSON line: the wall and process-CPU seconds of
``mb.plan`` (imports and the workload's construction excluded), the load average, and the plan.

To compare two source trees, run it alternately from each, several rounds, on the same machine:

    for i in 1 2 3 4 5; do for tree in /work/main /work/wt/speed2; do
        PYTHONPATH=$tree/src python benchmarks/planning_time.py --label $tree; done; done

    python benchmarks/planning_time.py [--label NAME] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

import microbatch as mb
from microbatch.models.workloads import gpt_workload
from microbatch.training.config import TrainConfig
from microbatch.training.run_plan import DEFAULT_CPU_MEMORY, _batch_bytes


class _Recorder(logging.Handler):
    """Keeps the planner's "profiled ..." messages: which sizes each profile measured, and in how long."""

    def __init__(self, found: list[str]) -> None:
        super().__init__(logging.INFO)
        self.found = found

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "profil" in message:
            self.found.append(message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="a name for this source tree in the output")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = TrainConfig()
    workload = gpt_workload(config.model)
    memory = mb.parse_bytes(DEFAULT_CPU_MEMORY) - _batch_bytes(workload.make_batch(1)) * config.batch
    profiles: list[str] = []
    handler = _Recorder(profiles)
    logging.getLogger("microbatch.planner").addHandler(handler)
    logging.getLogger("microbatch.planner").setLevel(logging.INFO)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = mb.plan(workload, batch=config.batch, memory=memory, max_grad_norm=config.max_grad_norm)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    row = {
        "label": args.label,
        "planning_wall_seconds": round(wall, 3),
        "planning_cpu_seconds": round(cpu, 3),
        "load_before": round(os.getloadavg()[0], 2),
        "threads": torch.get_num_threads(),
        "micro_batch_sizes": list(plan.micro_batch_sizes),
        "block_policies": [policy for _, policy in plan.block_policies],
        "predicted_seconds_per_step": plan.predicted_seconds_per_step,
        "profiles": profiles,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
