"""What each rank runs in the pipeline tests, and the data and model the reference rebuilds.

The model is the built-in GPT (tiny, float64, tied token embedding and output head), so the tied
copies on the first and last stages are exercised too. Each replica's micro-batches have different
row counts (padded by the pipeline) and very different token counts (labels -100 past a random
length).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from microbatch.distributed.pipeline import Pipeline
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPT, GPTConfig, token_loss

ROWS = 3  # rows of a full micro-batch (the example's)
LENGTH = 6
CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=8, block_size=LENGTH)

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model() -> GPT:
    torch.manual_seed(4321)
    return GPT(CONFIG).double()


def micro_batches(replica: int, rows: list[int]) -> list[Batch]:
    """Replica ``replica``'s micro-batches: ``rows[i]`` sequences each, with varied token counts."""
    batches = []
    for i, count in enumerate(rows):
        g = torch.Generator().manual_seed(1000 * replica + i)
        tokens = torch.randint(0, CONFIG.vocab_size, (count, LENGTH), generator=g)
        labels = torch.randint(0, CONFIG.vocab_size, (count, LENGTH), generator=g)
        lengths = torch.randint(1, LENGTH + 1, (count,), generator=g)
        labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
        batches.append((tokens, labels))
    return batches


def windows_of(rows_per_replica: list[list[int]], per_window: int) -> list[list[list[Batch]]]:
    """windows[w][r]: replica r's micro-batches of window w (per_window of them, fewer at the end)."""
    data = [micro_batches(r, rows) for r, rows in enumerate(rows_per_replica)]
    count = -(-max(len(d) for d in data) // per_window)
    return [[d[w * per_window : (w + 1) * per_window] for d in data] for w in range(count)]


def reference_grads(batches: list[Batch], max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Single-process full-batch gradient of the mean token loss over ``batches`` gathered."""
    model = make_model()
    tokens = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    token_loss(model(tokens), labels)[0].backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grads = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        grads[name] = parameter.grad.detach().clone()  # tied names share one gradient
    return grads


def _run(rows_per_replica: list[list[int]], schedule: str, m: int, steps: int, **options: Any) -> dict:
    """Train window by window (lr 0 keeps the weights); capture each window's stage gradients."""
    stages = options.pop("num_stages", 2)
    max_grad_norm = options.pop("max_grad_norm", None)
    pipe = Pipeline(
        make_model(),
        num_stages=stages,
        micro_batches=m,
        example=torch.zeros(ROWS, LENGTH, dtype=torch.long),
        loss_fn=token_loss,
        schedule=schedule,  # type: ignore[arg-type]
        **options,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)
    captured, stats = [], []
    for window in windows_of(rows_per_replica, m * steps):
        stat = pipe.backward(window[pipe.layout.replica_index], max_grad_norm=max_grad_norm)
        captured.append({name: p.grad.detach().clone() for name, p in pipe.named_parameters()})
        stats.append(stat.to_dict())
        pipe.step(optimizer)
    return {
        "grads": captured,
        "stats": stats,
        "stage_starts": pipe.stage_starts,
        "stages": pipe.stage_indices,
    }


def _torch_default(rows: list[int], m: int) -> dict[str, torch.Tensor]:
    """torch's own recipe: a mean loss per micro-batch, ScheduleGPipe's default scale_grads=True.
    torch cannot take micro-batches of different row counts, so the rows are all full here."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    batches = micro_batches(0, rows)
    pipe = pipeline(make_model(), mb_args=(batches[0][0],), split_spec={"blocks.2": SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, labels: token_loss(out, labels)[0])
    tokens = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    if rank == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=labels)
    return {
        name: p.grad.detach().clone() for name, p in stage.submod.named_parameters() if p.grad is not None
    }


def two_stages(rows: list[int], m: int) -> dict[str, Any]:
    """Every 2-rank scenario in one launch (spawning processes and tracing are the slow parts)."""
    result: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for steps in (1, 3):
            result[f"{schedule}-{steps}"] = _run([rows], schedule, m, steps)
    result["clip"] = _run([rows], "1f1b", m, 3, max_grad_norm=0.05)
    result["interleaved"] = _run([rows], "interleaved-1f1b", m, 1)
    result["named"] = _run([rows], "1f1b", m, 1, blocks=["blocks.1"])
    result["torch_default"] = _torch_default([ROWS] * m, m)
    result["errors"] = _errors(rows, m)
    result["peaks"] = {schedule: _measured_peak(schedule) for schedule in ("gpipe", "1f1b")}
    return result


MEMORY_CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16)
MEMORY_M = 4


def memory_batches() -> list[Batch]:
    g = torch.Generator().manual_seed(7)
    shape = (2, MEMORY_CONFIG.block_size)
    return [
        (torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
        for _ in range(MEMORY_M)
    ]


def _measured_peak(schedule: str) -> int:
    """This rank's peak live bytes over one window (first one, fresh gradients): MemoryTracker."""
    from microbatch.memory import MemoryTracker

    torch.manual_seed(0)
    data = memory_batches()
    pipe = Pipeline(
        GPT(MEMORY_CONFIG),
        num_stages=2,
        micro_batches=MEMORY_M,
        example=torch.zeros_like(data[0][0]),
        loss_fn=token_loss,
        schedule=schedule,  # type: ignore[arg-type]
    )
    with MemoryTracker(torch.device("cpu")) as tracker:
        pipe.backward(data)
    return int(tracker.peak_bytes)


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except ConfigError as error:
        return str(error)
    return None


def _errors(rows: list[int], m: int) -> dict[str, str | None]:
    """The clear errors, raised on every rank (none may hang the others)."""
    example = torch.zeros(ROWS, LENGTH, dtype=torch.long)

    def build(**options: Any) -> Pipeline:
        return Pipeline(make_model(), micro_batches=m, example=example, **options)

    def coupled() -> None:
        pipe = build(num_stages=2, loss_fn=lambda out, labels: token_loss(out, labels)[0])
        pipe.backward(micro_batches(0, rows[:2]))

    def too_many_rows() -> None:
        build(num_stages=2, loss_fn=token_loss).backward(micro_batches(0, [ROWS + 1]))

    return {
        "world_not_multiple": _error_of(lambda: build(num_stages=3, loss_fn=token_loss)),
        "coupled": _error_of(coupled),
        "too_many_rows": _error_of(too_many_rows),
    }


def dp_by_pp(rows_per_replica: list[list[int]], m: int) -> dict[str, Any]:
    """2 replicas x 2 stages on 4 ranks."""
    result: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        for steps in (1, 3):
            result[f"{schedule}-{steps}"] = _run(rows_per_replica, schedule, m, steps)
    result["clip"] = _run(rows_per_replica, "1f1b", m, 3, max_grad_norm=0.05)
    return result


# ---------------------------------------------------------------------- microbatch train --pipeline


def train_runs(root: str, stages: int, batch: int, micro_batch: int) -> dict[str, Any]:
    """``train --pipeline`` on this launch's ranks: a whole run, and the same run in two halves."""
    import dataclasses
    import os

    from microbatch.training import TrainConfig, train

    base = TrainConfig(
        model="gpt-nano",
        batch=batch,
        micro_batch=micro_batch,
        eval_interval=2,
        pipeline=stages,
        warmup_steps=2,
    )
    whole = train(dataclasses.replace(base, steps=4, out=os.path.join(root, "whole")))
    train(dataclasses.replace(base, steps=2, out=os.path.join(root, "halves")))
    resumed = train(dataclasses.replace(base, steps=4, out=os.path.join(root, "halves"), resume=True))
    return {"whole": whole.to_dict(), "resumed": resumed.to_dict()}


def train_plain(root: str, batch: int, micro_batch: int) -> dict[str, Any]:
    """The same run with DDP and no pipeline (each rank its own stream, as each replica has)."""
    import os

    from microbatch.training import TrainConfig, train

    config = TrainConfig(
        model="gpt-nano", batch=batch, micro_batch=micro_batch, eval_interval=2, warmup_steps=2, steps=4
    )
    return train(dataclasses_replace(config, out=os.path.join(root, "ddp"))).to_dict()


def dataclasses_replace(config: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(config, **changes)
