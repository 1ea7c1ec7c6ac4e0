"""``microbatch train --pipeline S``: the run's branch for a GPT cut into S pipeline stages.

With W processes there are R = W / S data-parallel replicas; rank r runs stage r % S of replica
r // S (distributed.stages). Each window is the replica's share of the batch (batch / R sequences),
cut into the plan's micro-batches (the last one may be shorter: padded with zero-weight rows) and
run as one pipeline step of torch's schedule, whose gradient is exact (distributed.pipeline).

The run folder, metrics, signals and resume are the ordinary run's. The stages hold copies of the
model's weights, so the whole model is gathered back into ``raw_model`` (all ranks, replica 0's
stages) before an evaluation and a checkpoint, and pushed into the stages after a resume; each
rank's optimizer holds its own stages' state and is checkpointed with the rank.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..accumulate.micro import WindowStats
from ..distributed.pipeline import Pipeline
from ..distributed.stages import find_block_names, stage_starts
from ..errors import ConfigError, InfeasibleBudgetError
from ..memory import parse_bytes
from ..models.gpt import GPT, token_loss
from ..models.workloads import IGNORE_INDEX, gpt_optimizer
from ..planner import Plan, plan
from ..planner.pipeline.choose import with_trial
from ..planner.pipeline.on_ranks import stage_peaks
from ..trees.batches import move_batch, split_batch
from ..workload import Workload
from .config import PRECISIONS

WHOLE_MODEL = "the whole model, kept on every rank (evaluation, checkpoints)"


def replicas(stages: int) -> int:
    return max(1, distributed.world_size() // stages)


def pipeline_plan(
    config: Any, workload: Workload, device: torch.device, start: Any, progress: Any = None
) -> Plan:
    """The run's pipeline plan, the same on every rank (a collective).

    A resumed run keeps its saved plan unless --memory or --plan changed. --plan FILE: a saved pipeline
    plan, proved on the ranks (each its own stage) unless --no-trial. --memory without --micro-batch:
    the planner (every rank calls it: every rank profiles, rank 0 searches, every rank proves its stage).
    Otherwise the manual split: --micro-batch, or batch / R / (2 S) sequences (m = 2S micro-batches
    per step, a bubble of (S - 1) / (m + S - 1), about a third), --checkpoint-policy on every block.
    """
    saved: Plan | None = start.saved_plan
    saved_config = start.saved_config
    if (
        saved is not None
        and saved_config is not None
        and saved.pipeline_stages == config.pipeline
        and (config.memory, config.plan) == (saved_config.memory, saved_config.plan)
    ):
        return saved
    if config.plan is not None:
        return _loaded(config, workload, config.plan)
    if config.memory is not None and config.micro_batch is None:
        return _planned(config, workload, device, progress)
    return _manual(config, workload.model, device)


def _planned(config: Any, workload: Workload, device: torch.device, progress: Any) -> Plan:
    """The planner on every rank, for the budget less the whole model that every rank also keeps
    (raw_model: evaluation and checkpoints gather the stages into it), which the plan then names."""
    budget = parse_bytes(config.memory, device=device, name="--memory")
    whole = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    policies = None if config.checkpoint_policy == "auto" else [config.checkpoint_policy]
    made: Plan = plan(
        workload,
        batch=config.batch,
        memory=budget - whole,
        pipeline=config.pipeline,
        pipeline_schedule=config.pipeline_schedule,
        world_size=distributed.world_size(),
        policies=policies,
        trial=config.trial,
        progress=progress,
        max_grad_norm=config.max_grad_norm,
    )
    measured = made.measured_stage_peak_bytes
    return dataclasses.replace(
        made,
        budget_bytes=budget,
        predicted_peak_bytes=made.predicted_peak_bytes + whole,
        measured_peak_bytes=made.measured_peak_bytes + whole if made.measured_peak_bytes else None,
        stage_peak_bytes=tuple(peak + whole for peak in made.stage_peak_bytes),
        measured_stage_peak_bytes=tuple(peak + whole for peak in measured),
        peak_parts=(*made.peak_parts, (WHOLE_MODEL, whole)),
    )


def _manual(config: Any, raw_model: nn.Module, device: torch.device) -> Plan:
    per_replica = config.batch // replicas(config.pipeline)
    micro_batch = config.micro_batch or max(1, math.ceil(per_replica / (2 * config.pipeline)))
    policy = "none" if config.checkpoint_policy == "auto" else config.checkpoint_policy
    blocks = find_block_names(raw_model)
    manual = Plan.manual(
        batch_size=config.batch,
        micro_batch_size=micro_batch,
        policies={name: policy for name in blocks},
        world_size=replicas(config.pipeline),
        workload=config.model,
        budget_bytes=parse_bytes(config.memory, device=device, name="--memory") if config.memory else 0,
        parameters=sum(p.numel() for p in raw_model.parameters()),
        device=device.type,
    )
    stages = config.pipeline
    interleaved = config.pipeline_schedule == "interleaved-1f1b"  # its cuts: "auto" for 2 S stages
    return dataclasses.replace(
        manual,
        pipeline_stages=stages,
        pipeline_schedule=config.pipeline_schedule,
        pipeline_micro_batches=manual.steps,
        stage_starts=() if interleaved else tuple(stage_starts(raw_model, stages, "auto")),
        bubble_fraction=(stages - 1) / (manual.steps + stages - 1),
    )


def _loaded(config: Any, workload: Workload, path: str) -> Plan:
    """--plan FILE with --pipeline: a pipeline plan for this run, proved on the ranks unless --no-trial."""
    loaded = Plan.load(path)
    if loaded.pipeline_stages != config.pipeline or loaded.batch_size != config.batch:
        raise ConfigError(
            f"--plan {path!r} is for batch {loaded.batch_size} in {loaded.pipeline_stages} pipeline "
            f"stage(s), this run is batch {config.batch} in {config.pipeline}; make the plan with "
            f"`microbatch plan ... --pipeline {config.pipeline}`, or pass --pipeline {loaded.pipeline_stages}"
        )
    loaded.check_model(workload.model, device=workload.device)
    if not config.trial:
        return loaded
    measured = stage_peaks(loaded, workload, autocast_dtype=PRECISIONS[config.precision])
    over = [s for s, peak in enumerate(measured) if peak > loaded.budget_bytes > 0]
    if over:
        raise InfeasibleBudgetError(
            f"--plan {path!r}: stage {over[0]} measured {measured[over[0]]:,} bytes in its trial, over the "
            f"plan's budget of {loaded.budget_bytes:,}; plan again with --memory",
            minimum_bytes=max(measured),
        )
    return with_trial(loaded, measured, loaded.trials + 1, "trial on the ranks (--plan): measured per stage")


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return token_loss(logits, labels, ignore_index=IGNORE_INDEX)


def build_pipeline(config: Any, raw_model: GPT, plan: Plan, device: torch.device) -> Pipeline:
    """The plan's stages of ``raw_model``: its cuts, schedule, micro-batches per step and checkpointing,
    each stage's forward under bf16 autocast with --precision bf16."""
    example = torch.zeros(plan.micro_batch_size, raw_model.config.block_size, dtype=torch.long, device=device)
    return plan.pipeline(
        raw_model,
        example=example,
        loss_fn=_loss,
        autocast_dtype=PRECISIONS[config.precision],
        ignore_index=IGNORE_INDEX,
    )


def pipeline_optimizer(pipe: Pipeline, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The GPT's AdamW over this rank's stage parameters (a ParameterList holds the same objects)."""
    return gpt_optimizer(nn.ParameterList(pipe.parameters()), lr=lr, weight_decay=weight_decay)


def data_seed(config: Any) -> int:
    """The stream of this rank's replica: every stage of a replica reads the same sequences."""
    return int(config.seed) * 1000 + distributed.rank() // int(config.pipeline)


def train_window(session: Any, peak: Any) -> tuple[WindowStats, float]:
    """One optimizer step of the pipeline: the replica's share of the batch, forward, backward, step."""
    pipe: Pipeline = session.pipeline
    started = time.perf_counter()
    plan: Plan = session.plan
    window_batch = session.train_data(sum(plan.micro_batch_sizes))
    micro_batches = [
        move_batch(m, session.device) for m in split_batch(window_batch, list(plan.micro_batch_sizes))
    ]
    pairs = [(m["input_ids"], m["labels"]) for m in micro_batches]
    with peak.measure(session.step + 1):
        stats = pipe.backward(pairs, max_grad_norm=session.config.max_grad_norm)
        lr = float(session.optimizer.param_groups[0]["lr"])
        pipe.step(session.optimizer, session.scheduler)
    window = WindowStats(
        loss=stats.loss,
        items=stats.items,
        grad_norm=stats.grad_norm,
        lr=lr,
        skipped=False,
        window=session.step,
        micro_batches=stats.micro_batches,
    )
    return window, time.perf_counter() - started


def gather_model_(pipe: Pipeline, raw_model: nn.Module) -> None:
    """Copy the stages' current weights into ``raw_model`` on every rank (a collective).

    Replica 0's ranks hold every stage once; the replicas are identical (same gradients, same steps).
    """
    mine = (
        {name: p.detach().cpu() for name, p in pipe.named_weights()} if pipe.layout.replica_index == 0 else {}
    )
    gathered: list[Any] = [None] * distributed.world_size()
    dist.all_gather_object(gathered, mine)
    merged = {name: tensor for part in gathered for name, tensor in part.items()}
    missing = []
    with torch.no_grad():
        for name, parameter in raw_model.named_parameters(remove_duplicate=False):
            if name in merged:
                parameter.copy_(merged[name])
            elif not any(other is parameter for n, other in raw_model.named_parameters() if n in merged):
                missing.append(name)
    if missing:
        raise ConfigError(f"the pipeline's stages hold no weight for {', '.join(missing[:3])}")


def scatter_model_(pipe: Pipeline, raw_model: nn.Module) -> None:
    """Copy ``raw_model``'s weights (just restored from a checkpoint) into this rank's stages."""
    weights = dict(raw_model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, parameter in pipe.named_weights():
            parameter.copy_(weights[name])
