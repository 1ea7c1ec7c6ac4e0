"""What each rank runs in the planned-pipeline tests: mb.plan(..., pipeline=S) on the ranks, the plan's
pipeline against the full batch, checkpointing and bf16 autocast inside the stages.

The model is the built-in GPT (tied token embedding and output head) on a token-level loss whose
micro-batches carry very different token counts (labels -100 past a random length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pipeline_workers as pw
import torch
from torch.utils.flop_counter import FlopCounterMode

import microbatch as mb
from microbatch import distributed
from microbatch.distributed.pipeline import Pipeline
from microbatch.models.gpt import GPT, GPTConfig, token_loss
from microbatch.planner.result.pipeline_build import stage_checkpointer
from microbatch.profile import profile_workload

PLAN_CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16)
BATCH = 13  # rows per replica: every micro-batch size but 1 and 13 leaves a short last micro-batch


def make_model(dtype: torch.dtype = torch.float64) -> GPT:
    torch.manual_seed(99)
    return GPT(PLAN_CONFIG).to(dtype)


def sample_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    length = PLAN_CONFIG.block_size
    tokens = torch.randint(0, PLAN_CONFIG.vocab_size, (rows, length), generator=g)
    labels = torch.randint(0, PLAN_CONFIG.vocab_size, (rows, length), generator=g)
    ends = torch.randint(1, length + 1, (rows,), generator=g)
    labels[torch.arange(length)[None, :] >= ends[:, None]] = -100
    return {"input_ids": tokens, "labels": labels}


def workload(dtype: torch.dtype = torch.float64) -> mb.Workload:
    calls = iter(range(10**6))

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss(model(batch["input_ids"]), batch["labels"])

    return mb.Workload(
        model=make_model(dtype),
        make_batch=lambda rows: sample_batch(rows, next(calls)),
        loss=loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
        name="gpt-plan-test",
        pipeline_inputs=lambda batch: (batch["input_ids"], batch["labels"]),
        pipeline_loss=token_loss,
    )


def window_data(sizes: list[int], replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``replica``'s micro-batches of one window, of the plan's sizes."""
    batches = [sample_batch(rows, 5000 + 100 * replica + i) for i, rows in enumerate(sizes)]
    return [(b["input_ids"], b["labels"]) for b in batches]


def plan_and_run(budgets: list[str], world: int) -> dict[str, Any]:
    """Every rank: mb.plan on the ranks for each budget (trial included), then the plan's pipeline on
    float64 data of the plan's split (one window per replica): its gradients, for the full batch."""
    profile = profile_workload(workload(), policies=["none", "full"]) if distributed.rank() == 0 else None
    results = []
    for budget in budgets:
        batch = BATCH * (world // 2)
        plan = mb.plan(workload(), batch=batch, memory=budget, pipeline=2, world_size=world, profile=profile)
        example = torch.zeros(plan.micro_batch_size, PLAN_CONFIG.block_size, dtype=torch.long)
        pipe = plan.pipeline(make_model(), example=example, loss_fn=token_loss)
        data = window_data(list(plan.micro_batch_sizes), pipe.layout.replica_index)
        with FlopCounterMode(display=False) as flops:
            stats = pipe.backward(data)
        grads = {name: p.grad.detach().clone() for name, p in pipe.named_parameters()}  # type: ignore[union-attr]
        counted = flops.get_total_flops()
        results.append({"plan": plan.to_dict(), "grads": grads, "flops": counted, "stats": stats.to_dict()})
    return {"results": results, "stages": pipe.stage_indices, "replica": pipe.layout.replica_index}


def reference(sizes: list[int], replicas: int) -> dict:
    """Single-process full-batch gradient of the mean token loss over every replica's window."""
    model = make_model()
    batches = [b for r in range(replicas) for b in window_data(sizes, r)]
    tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    token_loss(model(tokens), labels)[0].backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}  # type: ignore[union-attr]


# ---------------------------------------------------------------------- checkpointing and AMP in stages

CHECKPOINTED = {"blocks.0": "full", "blocks.1": "selective", "blocks.2": "full", "blocks.3": "none"}


def checkpointed_runs(rows: list[int], m: int) -> dict[str, Any]:
    """pipeline_workers' scenarios with the stages' blocks checkpointed (full / selective), and FLOPs."""
    result: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for steps in (1, 3):
            prepare = stage_checkpointer(CHECKPOINTED)
            result[f"{schedule}-{steps}"] = pw._run([rows], schedule, m, steps, prepare_stage=prepare)
    result["flops"] = {kind: _window_flops(rows[:m], kind) for kind in ("plain", "checkpointed")}
    result["amp"] = _amp(rows[:m], m)
    return result


def _window_flops(rows: list[int], kind: str) -> int:
    pipe = Pipeline(
        pw.make_model(),
        num_stages=2,
        micro_batches=len(rows),
        example=torch.zeros(pw.ROWS, pw.LENGTH, dtype=torch.long),
        loss_fn=token_loss,
        prepare_stage=stage_checkpointer(CHECKPOINTED) if kind == "checkpointed" else None,
    )
    with FlopCounterMode(display=False) as flops:
        pipe.backward(pw.micro_batches(0, rows))
    return int(flops.get_total_flops())


def _amp(rows: list[int], m: int) -> dict[str, Any]:
    """bf16 autocast in every stage on float32 weights: one window's stage gradients."""
    pipe = Pipeline(
        pw.make_model().float(),
        num_stages=2,
        micro_batches=m,
        example=torch.zeros(pw.ROWS, pw.LENGTH, dtype=torch.long),
        loss_fn=token_loss,
        autocast_dtype=torch.bfloat16,
    )
    stats = pipe.backward(pw.micro_batches(0, rows))
    grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
    return {"grads": grads, "stats": stats.to_dict()}


def amp_reference(rows: list[int], dtype: torch.dtype, autocast: bool) -> dict[str, torch.Tensor]:
    model = pw.make_model().to(dtype)
    batches = pw.micro_batches(0, rows)
    tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = token_loss(model(tokens), labels)[0]
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}  # type: ignore[union-attr]


def four_ranks(budgets: list[str]) -> dict[str, Any]:
    """2 replicas x 2 stages: planned on the ranks (each replica's own window of the plan's split)."""
    return plan_and_run(budgets, 4)


def two_ranks(budgets: list[str], rows: list[int], m: int) -> dict[str, Any]:
    """Every 2-rank scenario in one launch: planned pipelines, checkpointing and AMP in the stages."""
    return {"planned": plan_and_run(budgets, 2), "checkpointed": checkpointed_runs(rows, m)}


def train_planned(root: str, memory: str) -> dict[str, Any]:
    """``microbatch train --pipeline 2 --memory M`` (planned on the ranks), and a bf16 run with
    --checkpoint-policy full; each rank's summary and the plan."""
    import os

    from microbatch.training import TrainConfig, train

    base = TrainConfig(model="gpt-nano", batch=8, pipeline=2, steps=3, warmup_steps=1, eval_interval=3)
    planned = train(dataclasses.replace(base, memory=memory, out=os.path.join(root, "planned")))
    bf16 = TrainConfig(
        model="gpt-nano", batch=8, pipeline=2, steps=2, warmup_steps=1, micro_batch=2,
        precision="bf16", checkpoint_policy="full", out=os.path.join(root, "bf16"),
    )  # fmt: skip
    return {"planned": planned.to_dict(), "bf16": train(bf16).to_dict()}
