"""``microbatch train`` as a library: plan for this device's memory, train, leave a run folder.

    train(TrainConfig(...), progress=callback) -> TrainSummary

One run, from top to bottom: pick the device and the memory budget; build the GPT and the stdlib
corpus; choose a plan (micro-batch size, accumulation steps, checkpoint policy); train with the
Accumulator, one optimizer step per window of micro-batches; evaluate the validation loss at
intervals; write the run folder:

    runs/<name>/metrics.jsonl    one line per optimizer step (loss, items, lr, grad norm, peak bytes, ...)
    runs/<name>/plan.json        the plan and the budget it was made for
    runs/<name>/config.json      the TrainConfig
    runs/<name>/checkpoint.pt    model, optimizer, scheduler, scaler, accumulator, data and RNG state
    runs/<name>/loss.png         training and validation loss
    runs/<name>/summary.json     the TrainSummary

Checkpoints are written at window boundaries only, atomically (temporary file, fsync, rename).
Everything the next window depends on is in them, so resuming at step N and training to 2N gives
the same metrics and parameters as one run of 2N steps (bitwise on CPU). SIGINT finishes the
window in progress, saves and returns a summary marked ``interrupted``. Under torchrun every rank
trains on its own data stream and rank 0 alone writes files and reports progress.

    config.py      TrainConfig, its checks, lr / weight-decay / accumulation schedules
    plan.py        device, memory budget, choose_plan (the planner, or a fixed rule until it lands)
    run_folder.py  atomic writes, checkpoint files, metrics, loss.png
    loop.py        train(): setup, resume, windows, evaluation, SIGINT, summary
"""

from __future__ import annotations

from .config import TrainConfig, lr_factor, scaled_hyperparameters
from .loop import StepReport, TrainSummary, train
from .plan import DEFAULT_CPU_MEMORY, TrainPlan, choose_plan, fixed_plan, memory_budget_bytes
from .run_folder import latest_run_dir, load_checkpoint, resume_config

__all__ = [
    "DEFAULT_CPU_MEMORY",
    "StepReport",
    "TrainConfig",
    "TrainPlan",
    "TrainSummary",
    "choose_plan",
    "fixed_plan",
    "latest_run_dir",
    "load_checkpoint",
    "lr_factor",
    "memory_budget_bytes",
    "resume_config",
    "scaled_hyperparameters",
    "train",
]
