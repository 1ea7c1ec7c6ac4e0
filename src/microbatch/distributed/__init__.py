"""torch.distributed helpers: who am I, gradient sync per micro-batch, global counts.

``process``: rank, world size, starting and ending the process group, rank-0 logging;
``sync``: DDP / FSDP2 gradient sync switched per micro-batch; ``collectives``: control numbers
summed or maxed over ranks; ``pipeline``: a model cut into stages over the ranks (``Pipeline``, on
torch.distributed.pipelining) with exact item-weighted windows, ``pipeline_batches`` (padding,
pipeline steps, shape checks agreed by every rank), ``stages`` (the DP x PP layout and
where to cut) and ``stage_grads`` (sums over replicas and tied copies, the global norm); ``link`` measures the
ranks' point-to-point latency and bandwidth for the pipeline planner. ``launch`` (not
re-exported) starts N local processes for tests and benchmarks; users launch with torchrun.

May import: ``errors``, ``trees``, ``stepping``. Invariant: every collective runs on every rank at the same
point of the loop, or it would hang.
"""

from __future__ import annotations

from .collectives import all_reduce_max_, all_reduce_values, decided_on_rank_zero, destroy
from .pipeline import Pipeline, PipelineStats
from .process import (
    RankZeroFilter,
    init_from_env,
    is_initialized,
    is_rank_zero,
    launched_by_torchrun,
    local_rank,
    log_rank_zero,
    rank,
    single_process,
    world_size,
    world_size_from_env,
    wrap_data_parallel,
)
from .sync import ParallelKind, data_parallel_kind, ddp_sync, fsdp_sync

__all__ = [
    "ParallelKind",
    "Pipeline",
    "PipelineStats",
    "RankZeroFilter",
    "all_reduce_max_",
    "all_reduce_values",
    "data_parallel_kind",
    "ddp_sync",
    "decided_on_rank_zero",
    "destroy",
    "fsdp_sync",
    "init_from_env",
    "is_initialized",
    "is_rank_zero",
    "launched_by_torchrun",
    "local_rank",
    "log_rank_zero",
    "rank",
    "single_process",
    "world_size",
    "world_size_from_env",
    "wrap_data_parallel",
]
