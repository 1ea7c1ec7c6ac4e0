"""``microbatch train`` as a library: plan for this device's memory, train, leave a run folder.

    train(TrainConfig(...), progress=callback) -> TrainSummary

One run, from top to bottom (flow.py): check the config; open the run folder (or the
checkpoint to resume); make the plan (``microbatch.planner.Plan``: from the planner, from
``micro_batch`` via ``Plan.manual``, or from a saved plan file); build the session; train with
the Accumulator, one optimizer step per window of micro-batches, evaluating at intervals; write
the run folder:

    runs/<name>/metrics.jsonl    one line per optimizer step (loss, items, lr, grad norm, peak bytes, ...)
    runs/<name>/plan.json        the Plan (Plan.load reads it; microbatch train --plan takes it)
    runs/<name>/config.json      the TrainConfig
    runs/<name>/checkpoint.pt    model, optimizer, scheduler, scaler, accumulator, data and RNG state
    runs/<name>/loss.png         training and validation loss
    runs/<name>/summary.json     the TrainSummary of the whole run, across resumes

Checkpoints are written at window boundaries only, atomically (temporary file, fsync, rename);
temporaries left by killed writes are removed when a run starts or resumes. Everything the next
window depends on is in them, so resuming at step N and training to 2N gives the same metrics
and parameters as one run of 2N steps (bitwise on CPU). SIGINT, SIGTERM, SIGHUP, SIGUSR1/2 and
SIGXCPU finish the window in progress, save and return a summary marked ``interrupted``
(signals.py). Rank 0 holds the run folder's lock, on the folder itself, for the whole run and
writes through the folder opened once (ownership.py, pinned.py). A training-time
out-of-memory error re-plans and runs the window again (loop.py). Under torchrun every rank trains
on its own data stream, rank 0 alone plans, writes files and reports progress.

    config.py      TrainConfig, its checks, lr / weight-decay / accumulation schedules
    start.py       open a new run folder or a checkpoint to resume
    run_plan.py    device, memory budget, the run's Plan (rank 0 decides: distributed.decided_on_rank_zero)
    max_tokens.py  --max-tokens: micro-batches by padded tokens
    session.py     the live objects, the plan applied, checkpoint save / restore
    loop.py        the windows: evaluation, checkpoints, OOM recovery, skipped-step guard
    signals.py     SIGINT / SIGTERM / SIGHUP / ...: stop at a window boundary
    ownership.py   the run folder's marker and lock, folder names that never collide
    pinned.py      the run folder opened once: writes through its descriptor, a moved folder noticed
    integrity.py   checksums of the checkpoint and of the metrics it covers, verified on resume
    elastic.py     torchrun --max-restarts: restarted ranks resume; a dead peer named
    summary.py     StepReport, TrainSummary
    run_folder.py  atomic writes, checkpoint files, metrics, loss.png
    flow.py        train(): the steps above in order
    pipelined.py   --pipeline S: the run's windows through pipeline stages

May import every layer below it (``planner``, ``profile``, ``checkpointing``, ``accumulate``,
``distributed``, ``memory``, ``trees``, ``workload``, ``errors``) and ``models``; never ``commands``.
"""

from __future__ import annotations

from .config import TrainConfig, lr_factor, scaled_hyperparameters
from .flow import train
from .run_folder import latest_run_dir, load_checkpoint, resume_config
from .run_plan import DEFAULT_CPU_MEMORY, memory_budget_bytes
from .summary import StepReport, TrainSummary

__all__ = [
    "DEFAULT_CPU_MEMORY",
    "StepReport",
    "TrainConfig",
    "TrainSummary",
    "latest_run_dir",
    "load_checkpoint",
    "lr_factor",
    "memory_budget_bytes",
    "resume_config",
    "scaled_hyperparameters",
    "train",
]
