"""What a training run is asked to do (TrainConfig), its checks, and its lr / batch schedules."""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from .. import distributed
from ..accumulate import schedules
from ..errors import ConfigError, WorkloadError
from ..models.corpus import DEFAULT_MAX_BYTES
from ..models.gpt import GPT_SIZES, gpt_config
from .max_tokens import parse_max_tokens

logger = logging.getLogger(__name__)

# Learning rates that train each size well at effective batch 64 (AdamW, betas 0.9 / 0.95).
DEFAULT_LR = {"gpt-nano": 3e-3, "gpt-mini": 3e-3, "gpt-12l": 2e-3, "gpt-small": 6e-4, "gpt-medium": 3e-4}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_POLICIES = ("auto", "none", "full", "selective", "selective-half")
LR_SCALINGS = ("linear", "sqrt")
# A run stops with an error after this many optimizer steps in a row that were skipped (non-finite
# gradients under fp16): the model is not training, and a run must not "finish" like that.
DEFAULT_MAX_SKIPPED_WINDOWS = 20
# TrainConfig fields a resumed run may change; every other field must match the checkpoint's.
# A new --memory re-plans at the checkpoint's window boundary (the effective batch is unchanged).
RESUMABLE_CHANGES = frozenset(
    {"steps", "out", "resume", "eval_interval", "checkpoint_interval", "memory", "device", "plan", "trial"}
    | {"max_skipped_windows", "max_tokens"}  # max_tokens: how a window is split, not what it computes
)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how. Sizes are in sequences; ``memory`` is a peak-bytes budget.

    ``steps`` counts optimizer steps in total (a resumed run continues up to it). The learning rate
    warms up linearly over ``warmup_steps`` and then stays constant, or decays by a cosine to 10 %
    at ``lr_decay_steps`` when given; neither depends on ``steps``, so a run can be extended.
    The plan comes from the planner (``checkpoint_policy="auto"`` lets it choose per block; another
    policy limits it to that one), or from ``micro_batch`` (``Plan.manual``: that micro-batch size,
    ``checkpoint_policy`` on every repeated block, nothing measured), or from a file ``plan``
    (``Plan.load``, checked against the model and proved by one trial window unless ``trial`` is
    False). ``max_skipped_windows`` optimizer steps skipped in a row stop the run with an error.
    ``nominal_batch`` (Ultralytics' nbs): the batch the lr and weight decay were tuned for; weight
    decay is scaled by batch / nominal_batch, the lr by the same ratio (``lr_scaling="linear"``)
    or its square root (``"sqrt"``), and accumulation ramps up from 1 micro-batch over the warmup.
    """

    model: str = "gpt-mini"
    batch: int = 64
    memory: str | int | None = None
    steps: int = 200
    lr: float | None = None
    precision: str = "fp32"
    nominal_batch: int | None = None
    lr_scaling: str | None = None
    checkpoint_policy: str = "auto"
    out: str | None = None
    seed: int = 0
    resume: bool = False
    warmup_steps: int = 20
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    dropout: float = 0.0
    eval_interval: int | None = None
    eval_batches: int = 4
    checkpoint_interval: int | None = None
    corpus_bytes: int = DEFAULT_MAX_BYTES
    device: str | None = None
    max_tokens: str | int | None = "auto"  # micro-batches by padded tokens (training/max_tokens.py)
    micro_batch: int | None = None
    plan: str | None = None
    trial: bool = True
    max_skipped_windows: int = DEFAULT_MAX_SKIPPED_WINDOWS
    pipeline: int = 1  # pipeline stages (training/pipelined.py); world size = replicas x pipeline
    pipeline_schedule: str = "1f1b"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})


# --------------------------------------------------------------------------------------------------
# The run


def _check_finite(config: TrainConfig) -> None:
    """Refuse NaN and infinite hyperparameters: a run with them "finishes" with loss nan."""
    for flag, value in (
        ("--lr", config.lr),
        ("weight_decay", config.weight_decay),
        ("max_grad_norm", config.max_grad_norm),
        ("dropout", config.dropout),
    ):
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {config.dropout}")
    if config.weight_decay < 0:
        raise ConfigError(f"weight_decay must be >= 0, got {config.weight_decay}")
    if config.max_grad_norm is not None and config.max_grad_norm <= 0:
        raise ConfigError(f"max_grad_norm must be positive or None, got {config.max_grad_norm}")


def train_model_message(name: str) -> str:
    """Why train refuses ``name``: it trains the built-in GPT sizes; did you mean one of them."""
    close = difflib.get_close_matches(name, list(GPT_SIZES), n=2)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return (
        f"--model {name!r}: microbatch train trains the built-in GPT sizes only ({', '.join(GPT_SIZES)}) "
        f"on the embedded corpus.{hint} Your own workload (package.module:function) or an architecture "
        f"is for `microbatch plan {name} ...` and `microbatch verify {name}`; train it in your own loop "
        "with plan.apply(model, optimizer) (README, The loop)"
    )


def _host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _check_window_fits_host(config: TrainConfig) -> None:
    """Refuse at once a batch whose window of token ids cannot exist in this machine's memory.

    A window is drawn whole on the host (loop._window_batches): per-rank batch x block_size x
    2 int64 tensors (inputs, labels) = 16 bytes per token. A batch past that would be refused by the
    planner only after profiling (minutes), or fail allocating.
    """
    host_bytes = _host_memory_bytes()
    bytes_per_sequence = 16 * gpt_config(config.model).block_size
    world = max(1, distributed.world_size())
    if host_bytes is not None and config.batch // world * bytes_per_sequence > host_bytes:
        fits = host_bytes // bytes_per_sequence * world
        raise ConfigError(
            f"--batch {config.batch}: one window's token ids alone would take "
            f"{config.batch // world * bytes_per_sequence:,} bytes, more than this machine's "
            f"{host_bytes:,} bytes of memory; at most --batch {fits:,} fits"
        )


def validate_config(config: TrainConfig) -> None:
    """Raise ConfigError / WorkloadError naming the flag for any setting a run cannot use."""
    _check_finite(config)
    if isinstance(config.batch, bool) or not isinstance(config.batch, int) or config.batch <= 0:
        raise ConfigError(f"--batch must be a positive number of sequences, got {config.batch!r}")
    if config.model not in GPT_SIZES:
        raise WorkloadError(train_model_message(config.model))
    for ok, message in _flag_checks(config):
        if not ok:
            raise ConfigError(message)
    _check_window_fits_host(config)
    parse_max_tokens(config.max_tokens)
    world = distributed.world_size()
    if config.pipeline > 1:
        _check_pipeline(config, world)
        world //= config.pipeline  # the data-parallel replicas share the batch
    if config.batch % world:
        raise ConfigError(
            f"--batch {config.batch} must be a multiple of the number of processes ({world}); "
            f"use --batch {config.batch - config.batch % world or world}"
        )


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _check_pipeline(config: TrainConfig, world: int) -> None:
    """--pipeline S: what the pipelined run (training/pipelined.py) does not do yet is refused."""
    stages = config.pipeline
    checks = [
        (
            world % stages == 0,
            f"--pipeline {stages} needs a multiple of {stages} processes, got {world}; launch with "
            f"`torchrun --nproc-per-node {stages}` (or {2 * stages} for 2 data-parallel replicas)",
        ),
        (
            config.pipeline_schedule in PIPELINE_SCHEDULES,
            f"--pipeline-schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
            f"got {config.pipeline_schedule!r}",
        ),
        (
            config.precision != "fp16",
            "--pipeline takes --precision fp32 or bf16 (autocast in each stage): fp16's GradScaler is not "
            "built across pipeline stages",
        ),
        (
            config.memory is None
            or config.micro_batch is not None
            or config.pipeline_schedule != "interleaved-1f1b",
            "--memory plans --pipeline-schedule 1f1b or gpipe; interleaved-1f1b takes --micro-batch",
        ),
        (
            config.nominal_batch is None,
            "--nominal-batch ramps accumulation up over the warmup; --pipeline keeps whole windows, drop it",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _flag_checks(config: TrainConfig) -> list[tuple[bool, str]]:
    """(holds, message naming the flag) for every single-flag rule."""
    return [
        (config.steps >= 1, f"--steps must be >= 1, got {config.steps}"),
        (config.lr is None or config.lr > 0, f"--lr must be positive, got {config.lr}"),
        (
            config.precision in PRECISIONS,
            f"--precision must be one of {', '.join(PRECISIONS)}, got {config.precision!r}",
        ),
        (
            config.nominal_batch is None or config.nominal_batch > 0,
            f"--nominal-batch must be positive, got {config.nominal_batch}",
        ),
        (
            config.lr_scaling is None or config.lr_scaling in LR_SCALINGS,
            f"--lr-scaling must be linear or sqrt, got {config.lr_scaling!r}",
        ),
        (
            config.lr_scaling is None or config.nominal_batch is not None,
            "--lr-scaling scales the lr from --nominal-batch to --batch; give --nominal-batch too",
        ),
        (
            config.checkpoint_policy in CHECKPOINT_POLICIES,
            f"--checkpoint-policy must be one of {', '.join(CHECKPOINT_POLICIES)}, "
            f"got {config.checkpoint_policy!r}",
        ),
        (
            config.micro_batch is None or config.micro_batch >= 1,
            f"--micro-batch must be a positive number of sequences, got {config.micro_batch}",
        ),
        (
            config.micro_batch is None or config.plan is None,
            "--micro-batch and --plan both say how to split the batch; give one of them",
        ),
        (
            config.max_skipped_windows >= 1,
            f"max_skipped_windows must be >= 1, got {config.max_skipped_windows}",
        ),
        (config.warmup_steps >= 0, f"warmup_steps must be >= 0, got {config.warmup_steps}"),
        (
            config.eval_interval is None or config.eval_interval >= 1,
            f"--eval-interval must be >= 1, got {config.eval_interval}",
        ),
        (
            config.checkpoint_interval is None or config.checkpoint_interval >= 1,
            f"--checkpoint-interval must be >= 1, got {config.checkpoint_interval}",
        ),
        (config.eval_batches >= 1, f"eval_batches must be >= 1, got {config.eval_batches}"),
        (
            isinstance(config.pipeline, int) and config.pipeline >= 1,
            f"--pipeline must be a positive number of stages, got {config.pipeline!r}",
        ),
    ]


# --------------------------------------------------------------------------------------------------
# Schedules


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int | None) -> float:
    """Multiplier of the base lr before optimizer step ``step`` (0-based).

    Linear warmup (step + 1) / warmup_steps, then 1, or with ``decay_steps`` a cosine from 1 down to
    0.1 at decay_steps: 0.1 + 0.45 * (1 + cos(pi * progress)), constant 0.1 afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps is None or decay_steps <= warmup_steps:
        return 1.0
    progress = min((step - warmup_steps) / (decay_steps - warmup_steps), 1.0)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def scaled_hyperparameters(config: TrainConfig) -> tuple[float, float]:
    """(lr, weight decay) for the effective batch B, given the nominal batch nbs they were tuned for.

    lr x B / nbs (linear, Goyal et al. 2017) or x sqrt(B / nbs) (square root, common with Adam)
    when ``lr_scaling`` is set; weight decay x B / nbs as in Ultralytics (wd * b * accumulate / nbs,
    with b * accumulate = B).
    """
    lr = config.lr if config.lr is not None else DEFAULT_LR.get(config.model, 1e-3)
    if config.nominal_batch is None:
        return lr, config.weight_decay
    if config.lr_scaling is not None:
        rule: schedules.LRRule = "sqrt" if config.lr_scaling == "sqrt" else "linear"
        lr = schedules.scale_lr(lr, base_batch=config.nominal_batch, batch=config.batch, rule=rule)
    weight_decay = schedules.scaled_weight_decay(
        config.weight_decay, batch=config.batch, accumulation=1, nominal_batch=config.nominal_batch
    )
    return lr, weight_decay


def accumulation_schedule(
    config: TrainConfig, *, plan_steps: int, micro_batch_size: int
) -> int | Callable[[int], int]:
    """Micro-batches per window: the plan's, ramped up from 1 over the warmup with a nominal batch.

    Ultralytics' ramp (microbatch.accumulate.schedules.accumulation_schedule) over the micro-batches of the
    first ``warmup_steps`` full windows, ending at the plan's steps: afterwards every window holds
    the full effective batch.
    """
    if config.nominal_batch is None or plan_steps == 1 or config.warmup_steps == 0:
        return plan_steps
    return schedules.accumulation_schedule(
        batch=micro_batch_size,
        warmup_iterations=config.warmup_steps * plan_steps,
        nominal_batch=micro_batch_size * plan_steps,
    )
