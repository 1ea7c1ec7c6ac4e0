"""``PlanOptions``: everything ``plan()`` may be told besides the workload, the batch and the budget.

One frozen dataclass holds every option with its default and its check (torchtitan's config style):
``mb.plan(workload, batch=64, memory="8GiB", trial=False)`` builds ``PlanOptions(trial=False)``,
and ``mb.plan(workload, batch=64, memory="8GiB", options=PlanOptions(...))`` passes one directly.
A keyword that is not a field is refused, naming it and the fields there are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpointing.api import BlockSpec
from ..errors import ConfigError
from ..profile import Profile, ProgressFn
from .result.applying import GRADIENT_SYNCS

DEFAULT_MAX_TRIALS = 6
DEFAULT_MAX_PROFILE_SIZE = 16
SHARDS = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class PlanOptions:
    """How ``plan()`` profiles, searches and proves; each field's default is the usual choice.

    The budget: peak live tensor bytes on the CPU; on CUDA peak reserved bytes of the caching
    allocator plus what is measured outside it (see planner.reserve).
    """

    # Ranks the batch is split across (batch must divide by it); each rank gets the same plan.
    world_size: int = 1
    # Which blocks may be checkpointed ("auto": found) and how (None: none, full, selective, plus
    # offload on accelerators).
    blocks: BlockSpec = "auto"
    policies: Sequence[str] | None = None
    # A profile from profile_workload to reuse instead of profiling.
    profile: Profile | None = None
    # Prove the plan in one real window (recommended; False trusts the model).
    trial: bool = True
    # With the trial: plans the prediction cannot tell apart (within its tie) are timed in whole
    # windows and the fastest measured is kept (planner/proof/race.py).
    race: bool = True
    # Trials before the planner gives up (InfeasibleBudgetError).
    max_trials: int = DEFAULT_MAX_TRIALS
    # The largest micro-batch profiled; by default 16, extended to the micro-batch the search
    # chooses when that is larger (profiled before it is trusted).
    max_profile_micro_batch_size: int | None = None
    # Called as progress(what, done, total) while profiling runs and once per trial window (total 1).
    progress: ProgressFn | None = None
    # With world_size > 1 the plan counts DDP's gradient buckets, a second copy of the gradients,
    # unless DDP will run with gradient_as_bucket_view=True.
    gradient_as_bucket_view: bool = False
    # How the batch may be split (planner/search/rules.py).
    min_micro_batch_size: int = 1
    even: bool = False
    prefer_large_micro_batches: bool = False
    # A torch device (profile there for real) or a DeviceSpec / preset name (simulate).
    device: Any = None
    # Predict under fake tensors, no kernel run and no trial (planner/target/simulated.py).
    simulate: bool = False
    # none, ddp or fsdp across world_size ranks (per-rank memory, planner/target/per_rank.py).
    shard: str = "none"
    # Options that change memory, so the profile and the trial run with them and plan.apply holds to
    # them (planner/result/applying.py): low-precision gradients summed in this dtype (Accumulator's
    # accumulate_dtype), a GradScaler stepping the window, and under shard="fsdp" the gradient sync:
    # "window" (reduce-scatter once, unsharded gradients held), "micro-batch" (every backward), or
    # None: the faster plan that fits of the two (planner/target/per_rank.py).
    accumulate_dtype: torch.dtype | None = None
    scaler: bool = False
    gradient_sync: str | None = None
    # Pipeline stages (planner/pipeline/choose.py): world_size is then every rank (1: the S ranks of one
    # replica), cut into world_size / pipeline data-parallel replicas of ``pipeline`` stages; the
    # planner chooses the schedule (or takes ``pipeline_schedule``: "1f1b" or "gpipe"), the
    # micro-batches per pipeline step, where to cut and a policy per block.
    pipeline: int = 1
    pipeline_schedule: str | None = None
    # Gradients clipped to this total norm once per window (Accumulator's max_grad_norm).
    max_grad_norm: float | None = None
    # The loss head in chunks of c tokens (planner/levers/head_choice.py): the sizes c to price
    # beside no chunks. None: (256, 1024, 4096) when no plan fits without chunks, the model's head is one
    # microbatch can chunk and its vocabulary is at least 16x its width (the logits dominate); (): never.
    head: Sequence[int] | None = None
    # With ``profile`` given: head_profile(c) is the same profile with the head in chunks of c tokens
    # (the CLI's simulated architectures); without it a given profile keeps its head.
    head_profile: Callable[[int], Profile] | None = None
    # False: the planner without its exact levers (planner/levers/): no head chunks, the optimizer's
    # own step, and a refusal that names no lever; what it planned before them, for comparisons.
    exact_levers: bool = True

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("max_trials", self.max_trials)
        _positive_int("min_micro_batch_size", self.min_micro_batch_size)
        _positive_int("pipeline", self.pipeline)
        if self.pipeline_schedule not in (None, "1f1b", "gpipe"):
            raise ConfigError(
                f"pipeline_schedule={self.pipeline_schedule!r}: choose 1f1b or gpipe, or None (the planner "
                "chooses)"
            )
        if self.pipeline > 1 and self.world_size > 1 and self.world_size % self.pipeline:
            raise ConfigError(
                f"world_size={self.world_size} is not a multiple of pipeline={self.pipeline}: every "
                f"data-parallel replica is {self.pipeline} ranks; use a multiple of {self.pipeline}"
            )
        if self.max_profile_micro_batch_size is not None:
            _positive_int("max_profile_micro_batch_size", self.max_profile_micro_batch_size)
        if self.shard not in SHARDS:
            raise ConfigError(f"shard={self.shard!r}: choose one of {', '.join(SHARDS)}")
        if self.gradient_sync not in (None, *GRADIENT_SYNCS):
            raise ConfigError(
                f"gradient_sync={self.gradient_sync!r}: choose one of {', '.join(GRADIENT_SYNCS)}, or None "
                "(the planner chooses)"
            )
        if self.accumulate_dtype is not None and not (
            isinstance(self.accumulate_dtype, torch.dtype) and self.accumulate_dtype.is_floating_point
        ):
            raise ConfigError(
                "accumulate_dtype must be a floating torch.dtype such as torch.float32, "
                f"got {self.accumulate_dtype!r}"
            )
        check_max_grad_norm(self.max_grad_norm, "max_grad_norm")
        if self.head is not None:
            if isinstance(self.head, (str, bytes)) or not isinstance(self.head, Sequence):
                raise ConfigError(
                    f"head must be a list of tokens per chunk (or None: auto), got {self.head!r}"
                )
            for tokens in self.head:
                _positive_int("head (tokens per chunk)", tokens)
            if self.head and not self.exact_levers:
                raise ConfigError(
                    f"head={list(self.head)} with exact_levers=False: the head's chunks are an exact lever; "
                    "leave head out or set exact_levers=True"
                )
        names = (
            "trial",
            "gradient_as_bucket_view",
            "even",
            "prefer_large_micro_batches",
            "simulate",
            "scaler",
            "exact_levers",
            "race",
        )
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, options: PlanOptions | None, keywords: Mapping[str, Any]) -> PlanOptions:
        """``options`` (or the defaults) with ``keywords`` replacing fields; unknown keywords refused."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise ConfigError(
                f"plan() got unknown option(s) {', '.join(unknown)}; the options are: {', '.join(names)}"
            )
        base = options if options is not None else cls()
        if not isinstance(base, PlanOptions):
            raise ConfigError(f"options must be a PlanOptions, got {type(base).__name__}")
        return dataclasses.replace(base, **keywords) if keywords else base


def check_max_grad_norm(value: object, name: str) -> None:
    """None, or a finite number > 0 (what Accumulator's max_grad_norm clips to)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a finite number > 0 (or None: no clipping), got {value!r}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
