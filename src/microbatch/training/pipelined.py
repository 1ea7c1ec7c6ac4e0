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

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..accumulate.micro import WindowStats
from ..distributed.pipeline import Pipeline
from ..errors import ConfigError
from ..models.gpt import GPT, token_loss
from ..models.workloads import IGNORE_INDEX, gpt_optimizer
from ..planner import Plan
from ..trees.batches import move_batch, split_batch


def replicas(stages: int) -> int:
    return max(1, distributed.world_size() // stages)


def pipeline_plan(config: Any, raw_model: GPT, device: torch.device) -> Plan:
    """The run's split: --micro-batch, or batch / R / (2 S) sequences (m = 2S micro-batches per step,
    a bubble of (S - 1) / (m + S - 1), about a third). The same on every rank (no profiling)."""
    per_replica = config.batch // replicas(config.pipeline)
    micro_batch = config.micro_batch or max(1, math.ceil(per_replica / (2 * config.pipeline)))
    return Plan.manual(
        batch_size=config.batch,
        micro_batch_size=micro_batch,
        world_size=replicas(config.pipeline),
        workload=config.model,
        parameters=raw_model.num_parameters(),
        device=device.type,
    )


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return token_loss(logits, labels, ignore_index=IGNORE_INDEX)


def build_pipeline(config: Any, raw_model: GPT, plan: Plan, device: torch.device) -> Pipeline:
    example = torch.zeros(plan.micro_batch_size, raw_model.config.block_size, dtype=torch.long, device=device)
    return Pipeline(
        raw_model,
        num_stages=config.pipeline,
        micro_batches=plan.steps,
        example=example,
        loss_fn=_loss,
        schedule=config.pipeline_schedule,
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
        {name: p.detach().cpu() for name, p in pipe.named_parameters()}
        if pipe.layout.replica_index == 0
        else {}
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
        for name, parameter in pipe.named_parameters():
            parameter.copy_(weights[name])
