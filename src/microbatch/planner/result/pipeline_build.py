"""A pipeline plan put to use: the Pipeline it describes, with its checkpointing inside each stage.

``plan.pipeline(model, example=..., loss_fn=...)`` cuts ``model`` where the plan says, under its
schedule and its micro-batches per pipeline step, and checkpoints each stage's blocks with the
plan's policies (``mb.checkpoint`` on the stage module, which keeps the model's module names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...checkpointing.api import CheckpointHandle, checkpoint
from ...distributed import world_size
from ...distributed.pipeline import LossFn, Pipeline
from ...errors import ConfigError
from ...stepping.step_guard import refuse_option

Plan = Any  # plans.Plan (plans.py imports this module)


def stage_checkpointer(policies: Mapping[str, str]) -> Any:
    """``prepare_stage`` for a Pipeline: checkpoint the stage's blocks that ``policies`` checkpoints."""

    def prepare(stage: nn.Module) -> CheckpointHandle | None:
        names = {name for name, _ in stage.named_modules()}
        mine = {name: policy for name, policy in policies.items() if name in names and policy != "none"}
        return checkpoint(stage, policy=mine) if mine else None

    return prepare


def build_pipeline(
    plan: Plan,
    model: nn.Module,
    *,
    example: torch.Tensor,
    loss_fn: LossFn,
    autocast_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
) -> Pipeline:
    """The plan's Pipeline over this launch's ranks (every rank calls it, with the same model)."""
    if plan.pipeline_stages <= 1:
        raise ConfigError(
            "this plan has no pipeline (pipeline_stages=1); use plan.apply(model, optimizer), or plan with "
            "mb.plan(..., pipeline=S)"
        )
    # The Pipeline keeps the Accumulator's step rules but has no GradScaler and no wide sums: refused
    # by name rather than run without them (a saved plan may carry either).
    if plan.scaler:
        refuse_option(
            "scaler",
            plan.scaler,
            "a pipeline plan",
            "fp16's GradScaler is not supported in "
            "pipeline stages; plan with bf16 autocast (autocast_dtype=torch.bfloat16) or float32",
        )
    if plan.accumulate_dtype is not None:
        refuse_option(
            "accumulate_dtype",
            plan.accumulate_dtype,
            "a pipeline plan",
            "the pipeline sums "
            "each stage's gradients in the parameters' dtype; plan without accumulate_dtype",
        )
    ranks = plan.world_size * plan.pipeline_stages
    if world_size() != ranks:
        raise ConfigError(
            f"the plan is for {plan.world_size} replica(s) x {plan.pipeline_stages} stages = {ranks} ranks, "
            f"this launch has {world_size()}; launch `torchrun --nproc-per-node {ranks}` or plan again"
        )
    if example.shape[0] != plan.micro_batch_size:
        raise ConfigError(
            f"example has {example.shape[0]} rows, the plan's micro-batches {plan.micro_batch_size}: pass "
            "one full micro-batch of inputs (the shape every micro-batch is padded to)"
        )
    return Pipeline(
        model,
        num_stages=plan.pipeline_stages,
        micro_batches=plan.pipeline_micro_batches,
        example=example,
        loss_fn=loss_fn,
        schedule=plan.pipeline_schedule,
        blocks=list(plan.stage_starts) or "auto",
        ignore_index=ignore_index,
        prepare_stage=stage_checkpointer(plan.policies) if plan.checkpointed_blocks else None,
        autocast_dtype=autocast_dtype,
    )
