"""The training loop: set up a run (new or resumed), train window by window, save, summarise."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

import torch
from torch import nn

from .. import distributed
from ..accumulate import Accumulator, WindowStats
from ..batching import move_batch, split_batch
from ..errors import ConfigError, MicrobatchError, ResumeError, WorkloadError
from ..memory import MemoryTracker, format_bytes
from ..models.corpus import ByteBatches, load_corpus
from ..models.gpt import GPT, GPTConfig, gpt_config
from ..models.workloads import build_seeded, gpt_loss, gpt_optimizer
from ..workload import Workload
from .config import (
    PRECISIONS,
    RESUMABLE_CHANGES,
    TrainConfig,
    accumulation_schedule,
    lr_factor,
    scaled_hyperparameters,
    validate_config,
)
from .plan import TrainPlan, apply_checkpointing, choose_plan, memory_budget_bytes, resolve_device
from .run_folder import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    CONFIG_FILE,
    METRICS_FILE,
    PLAN_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    atomic_write,
    check_writable,
    latest_run_dir,
    load_checkpoint,
    plot_losses,
    prepare_run_dir,
    read_metrics,
    write_json,
)
from .tokens import TokenSteps, resolve_max_tokens, split_window

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class StepReport:
    """What the progress display gets after every optimizer step."""

    step: int
    total_steps: int
    loss: float
    lr: float
    tokens_per_second: float
    peak_bytes: int
    eta_seconds: float
    val_loss: float | None


@dataclass(frozen=True)
class TrainSummary:
    """The outcome of a run (also written to summary.json)."""

    run_dir: str
    model: str
    steps_done: int
    total_steps: int
    first_loss: float | None
    final_loss: float | None
    val_loss: float | None
    tokens: int
    seconds: float
    tokens_per_second: float
    peak_bytes: int
    peak_bytes_source: str
    parameters: int
    device: str
    plan: dict[str, Any]
    resumed_from_step: int | None
    interrupted: bool
    checkpoint: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        val = f", validation loss {self.val_loss:.4f}" if self.val_loss is not None else ""
        loss = (
            f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}"
            if self.final_loss is not None
            else "no steps"
        )
        state = "interrupted" if self.interrupted else "finished"
        return (
            f"{state} {self.steps_done}/{self.total_steps} steps of {self.model} on {self.device}: "
            f"{loss}{val}; "
            f"{self.tokens:,} tokens in {self.seconds:.1f} s ({self.tokens_per_second:,.0f} tokens/s), "
            f"peak {format_bytes(self.peak_bytes)} ({self.peak_bytes_source}); run folder {self.run_dir}"
        )


# --------------------------------------------------------------------------------------------------
# Peak memory, SIGINT


class _PeakMemory:
    """Peak bytes of each optimizer step.

    CUDA: the allocator's max_memory_allocated, every step. Elsewhere: MemoryTracker's peak live
    tensor bytes (model, gradients, optimizer state, activations), on the first two steps (the first
    creates the optimizer state) and every ``every`` steps only, because tracking costs 15-30 % of
    a CPU step. The plan is fixed, so a step's peak repeats; a step that is not measured reports
    the latest measurement (``measured`` False).
    """

    def __init__(self, session: _Session, *, every: int) -> None:
        self.session = session
        self.every = every
        self.source = "cuda-allocator" if session.device.type == "cuda" else "tracker"
        self.last_bytes = 0
        self.measured = False

    @contextlib.contextmanager
    def measure(self, step: int) -> Iterator[None]:
        device = self.session.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            yield
            self.last_bytes, self.measured = int(torch.cuda.max_memory_allocated(device)), True
        elif step <= 2 or step % self.every == 0:
            tracker = MemoryTracker(device, model=self.session.raw_model, optimizer=self.session.optimizer)
            with tracker:
                yield
            self.last_bytes, self.measured = int(tracker.peak_bytes), True
        else:
            yield
            self.measured = False


class _StopFlag:
    """SIGINT (the first one) asks the loop to stop at the next window boundary; a second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        if distributed.is_rank_zero():
            logger.warning("interrupted: finishing this optimizer step, then saving (Ctrl-C again to abort)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, self._previous)

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (one max all-reduce under torchrun)."""
        if distributed.world_size() == 1:
            return self.requested
        (flag,) = distributed.all_reduce_values([1.0 if self.requested else 0.0], op="max")
        return flag > 0


def _default_run_dir(config: TrainConfig) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{config.model}-{stamp}")


def _check_resume_matches(config: TrainConfig, saved: TrainConfig, path: str) -> None:
    mismatched = [
        f"{f.name}={getattr(config, f.name)!r} (checkpoint: {getattr(saved, f.name)!r})"
        for f in fields(TrainConfig)
        if f.name not in RESUMABLE_CHANGES and getattr(config, f.name) != getattr(saved, f.name)
    ]
    if mismatched:
        raise ResumeError(
            f"--resume: {path!r} was written by a different run: {'; '.join(mismatched)}. "
            "Resume with the run's own settings (only --steps may change), or start a new run "
            "with a different --out; nothing was changed"
        )


@dataclass
class _Session:
    """The live objects of a run."""

    config: TrainConfig
    run_dir: str
    device: torch.device
    model: nn.Module
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    accumulator: Accumulator
    plan: TrainPlan
    train_data: ByteBatches
    validation: list[dict[str, torch.Tensor]]
    autocast_dtype: torch.dtype | None
    checkpoint_handle: Any
    step: int = 0
    resumed_from_step: int | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    token_steps: TokenSteps | None = None  # set when micro-batches are split by tokens


def _build_model(config: TrainConfig) -> GPT:
    model_config: GPTConfig = gpt_config(config.model, dropout=config.dropout)
    model: GPT = build_seeded(lambda: GPT(model_config), config.seed)
    return model


def _validation_batches(
    config: TrainConfig, block_size: int, micro_batch_size: int
) -> list[dict[str, torch.Tensor]]:
    # The same validation sequences at every evaluation, on every rank: a fixed seed of their own.
    corpus = load_corpus(max_bytes=config.corpus_bytes)
    source = ByteBatches(corpus.validation, block_size=block_size, seed=10_000 + config.seed)
    return [source(micro_batch_size) for _ in range(config.eval_batches)]


def _plan_new_run(
    config: TrainConfig, model: GPT, documents: tuple[bytes, ...], device: torch.device
) -> TrainPlan:
    # The planner draws from a stream of its own, so the training stream starts untouched.
    planning_data = ByteBatches(documents, block_size=model.config.block_size, seed=config.seed + 777)
    probe = Workload(
        model=model,
        make_batch=lambda b: move_batch(planning_data(b), device),
        loss=gpt_loss,
        name=config.model,
    )
    plan = choose_plan(
        probe,
        batch=config.batch,
        memory_bytes=memory_budget_bytes(config.memory, device),
        world_size=distributed.world_size(),
        policy=config.checkpoint_policy,
        planner=config.planner,
    )
    model.zero_grad(set_to_none=True)
    return plan


def _on_rank_zero(decide: Callable[[], _T]) -> _T:
    """``decide()`` on rank 0 and its result on every rank; its error, if any, raised on every rank.

    Under torchrun, choices that must agree (the run folder's name, the plan) are made once.
    """
    if distributed.world_size() == 1:
        return decide()
    payload: list[Any] = [None]
    error: MicrobatchError | None = None
    if distributed.is_rank_zero():
        try:
            payload[0] = ("result", decide())
        except MicrobatchError as raised:
            error, payload[0] = raised, ("error", str(raised))
    torch.distributed.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    kind, value = payload[0]
    if kind == "error":
        raise ConfigError(f"rank 0 stopped: {value}")
    result: _T = value
    return result


def _check_new_run(config: TrainConfig) -> str:
    """The new run's folder, checked but not created yet (a run that fails to start leaves nothing)."""
    run_dir = config.out or _default_run_dir(config)
    if os.path.isfile(os.path.join(run_dir, CHECKPOINT_FILE)):
        raise ConfigError(
            f"--out {run_dir!r} already holds a run; continue it with --resume, or choose another --out"
        )
    check_writable(run_dir)
    return run_dir


def _setup(config: TrainConfig) -> _Session:
    validate_config(config)
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state: dict[str, Any] | None = None
    if config.resume:
        run_dir = _on_rank_zero(lambda: config.out or latest_run_dir())
        path = os.path.join(run_dir, CHECKPOINT_FILE)
        state = load_checkpoint(path)
        try:
            saved_config, saved_plan = TrainConfig.from_dict(state["config"]), TrainPlan(**state["plan"])
        except (KeyError, TypeError) as error:
            raise ResumeError(
                f"--resume: {path!r} lacks a readable config or plan ({error}); nothing was changed"
            ) from error
        _check_resume_matches(config, saved_config, path)
    else:
        run_dir = _on_rank_zero(lambda: _check_new_run(config))

    raw_model = _build_model(config).to(device)
    corpus = load_corpus(max_bytes=config.corpus_bytes)
    rank, world = distributed.rank(), distributed.world_size()
    # Each rank reads its own stream; rank r's seed is derived from the run's seed.
    train_data = ByteBatches(
        corpus.train, block_size=raw_model.config.block_size, seed=config.seed * 1000 + rank
    )
    if state is not None:
        plan = saved_plan
        if plan.world_size != world:
            raise ResumeError(
                f"--resume: the run was trained with {plan.world_size} process(es), now {world}; "
                f"resume it with {plan.world_size}"
            )
    else:
        plan = _on_rank_zero(lambda: _plan_new_run(config, raw_model, corpus.train, device))
        _on_rank_zero(lambda: prepare_run_dir(run_dir))
    checkpoint_handle = apply_checkpointing(raw_model, plan.checkpoint_policy)

    model: nn.Module = raw_model
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    lr, weight_decay = scaled_hyperparameters(config)
    optimizer = gpt_optimizer(raw_model, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup_steps=config.warmup_steps, decay_steps=config.lr_decay_steps),
    )
    scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
    steps = accumulation_schedule(config, plan_steps=plan.steps, micro_batch_size=plan.micro_batch_size)
    max_tokens = resolve_max_tokens(
        config.max_tokens, micro_batch_size=plan.micro_batch_size, block_size=raw_model.config.block_size
    )
    token_steps = TokenSteps(steps, max_tokens) if max_tokens is not None else None
    accumulator = Accumulator(
        model,
        optimizer,
        steps=token_steps or steps,
        scheduler=scheduler,
        max_grad_norm=config.max_grad_norm,
        scaler=scaler,
    )
    session = _Session(
        config=config,
        run_dir=run_dir,
        device=device,
        model=model,
        raw_model=raw_model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        accumulator=accumulator,
        plan=plan,
        train_data=train_data,
        validation=_validation_batches(config, raw_model.config.block_size, plan.micro_batch_size),
        autocast_dtype=PRECISIONS[config.precision],
        checkpoint_handle=checkpoint_handle,
        token_steps=token_steps,
    )
    if state is not None:
        _restore(session, state)
    return session


def _checkpoint_state(session: _Session) -> dict[str, Any]:
    # Every rank's data stream and random state (a collective under torchrun), indexed by rank.
    rng = {"torch": torch.get_rng_state()}
    if session.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(session.device)
    rank_states: list[Any] = [{"data": session.train_data.state_dict(), "rng": rng}]
    if distributed.world_size() > 1:
        rank_states = [None] * distributed.world_size()
        torch.distributed.all_gather_object(
            rank_states, {"data": session.train_data.state_dict(), "rng": rng}
        )
    return {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "step": session.step,
        "config": session.config.to_dict(),
        "model_config": session.raw_model.config.to_dict(),
        "plan": session.plan.to_dict(),
        "model": session.raw_model.state_dict(),
        "optimizer": session.optimizer.state_dict(),
        "scheduler": session.scheduler.state_dict(),
        "scaler": session.scaler.state_dict() if session.scaler is not None else None,
        "accumulator": session.accumulator.state_dict(),
        "ranks": rank_states,
    }


def _restore(session: _Session, state: dict[str, Any]) -> None:
    path = os.path.join(session.run_dir, CHECKPOINT_FILE)
    try:
        session.raw_model.load_state_dict(state["model"])
        session.optimizer.load_state_dict(state["optimizer"])
        session.scheduler.load_state_dict(state["scheduler"])
        if session.scaler is not None and state["scaler"] is not None:
            session.scaler.load_state_dict(state["scaler"])
        session.accumulator.load_state_dict(state["accumulator"])
        rank_state = state["ranks"][distributed.rank()]
        session.train_data.load_state_dict(rank_state["data"])
        torch.set_rng_state(rank_state["rng"]["torch"])
        if session.device.type == "cuda" and "cuda" in rank_state["rng"]:
            torch.cuda.set_rng_state(rank_state["rng"]["cuda"], session.device)
        session.step = int(state["step"])
    except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as error:
        raise ResumeError(
            f"--resume: {path!r} does not match this run ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); nothing was changed"
        ) from error
    session.resumed_from_step = session.step
    session.metrics = read_metrics(os.path.join(session.run_dir, METRICS_FILE), up_to_step=session.step)


def _save(session: _Session) -> None:
    state = _checkpoint_state(session)  # a collective under torchrun: every rank takes part
    if not distributed.is_rank_zero():
        return
    atomic_write(os.path.join(session.run_dir, CHECKPOINT_FILE), lambda file: torch.save(state, file))


def _start_metrics(session: _Session) -> None:
    """metrics.jsonl as of the checkpoint: empty for a new run; a resumed run drops later lines."""
    text = "".join(json.dumps(record) + "\n" for record in session.metrics)
    atomic_write(os.path.join(session.run_dir, METRICS_FILE), lambda file: file.write(text), binary=False)


def _append_metrics(session: _Session, record: dict[str, Any]) -> None:
    with open(os.path.join(session.run_dir, METRICS_FILE), "a") as file:
        file.write(json.dumps(record) + "\n")


def _autocast(session: _Session) -> contextlib.AbstractContextManager[Any]:
    if session.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(session.device.type, dtype=session.autocast_dtype)


@torch.no_grad()
def evaluate(session: _Session) -> float:
    """Token-weighted mean validation loss over the fixed validation batches."""
    session.raw_model.eval()
    total_loss, total_tokens = 0.0, 0
    try:
        for batch in session.validation:
            with _autocast(session):
                loss, tokens = gpt_loss(session.raw_model, move_batch(batch, session.device))
            total_loss += float(loss) * tokens
            total_tokens += tokens
    finally:
        session.raw_model.train()
    return total_loss / max(total_tokens, 1)


def _window_batches(session: _Session, window: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a window, drawn at once and then cut into the plan's micro-batches.

    Drawing the whole window first makes the data independent of the split: any plan (micro-batch
    size, steps) trains on the same sequences, so plans differ only by rounding. The token ids of a
    window are small (batch x block_size int64) next to the activations of one micro-batch.
    """
    token_steps = session.token_steps
    steps = token_steps.row_steps(window) if token_steps else session.accumulator.steps_for(window)
    sizes = session.plan.micro_batch_sizes()
    if steps != len(sizes):  # accumulation warmup: fewer, full micro-batches
        sizes = [session.plan.micro_batch_size] * steps
    window_batch = session.train_data(sum(sizes))
    if token_steps is not None:  # the same sequences, split by padded tokens instead of rows
        split = split_window(window_batch, token_steps, window)
        return [move_batch(micro, session.device) for micro in split]
    return [move_batch(micro, session.device) for micro in split_batch(window_batch, sizes)]


def _run_window(session: _Session, micro_batches: list[dict[str, torch.Tensor]]) -> WindowStats:
    stats: WindowStats | None = None
    for micro in session.accumulator.iterate(micro_batches):
        with _autocast(session):
            loss, tokens = gpt_loss(session.model, micro.batch)
        # A micro-batch of padding only (impossible with ByteBatches' lengths >= 1) still needs items >= 1.
        session.accumulator.backward(loss, items=max(tokens, 1))
        if micro.is_last:
            stats = session.accumulator.step()
    if stats is None:  # iterate() always ends a window with is_last; this guards the type only
        raise WorkloadError("the training window produced no micro-batches")
    return stats


def _intervals(config: TrainConfig) -> tuple[int, int]:
    eval_interval = config.eval_interval or max(1, min(50, config.steps // 5))
    checkpoint_interval = config.checkpoint_interval or max(eval_interval, 50)
    return eval_interval, checkpoint_interval


def _finish(
    session: _Session, *, seconds: float, tokens: int, peak: _PeakMemory, interrupted: bool
) -> TrainSummary:
    metrics = session.metrics
    losses = [record["loss"] for record in metrics]
    val_losses = [record["val_loss"] for record in metrics if record.get("val_loss") is not None]
    summary = TrainSummary(
        run_dir=session.run_dir,
        model=session.config.model,
        steps_done=session.step,
        total_steps=session.config.steps,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        val_loss=val_losses[-1] if val_losses else None,
        tokens=tokens,
        seconds=seconds,
        tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
        peak_bytes=max((int(record["peak_bytes"]) for record in metrics), default=0),
        peak_bytes_source=peak.source,
        parameters=session.raw_model.num_parameters(),
        device=str(session.device),
        plan=session.plan.to_dict(),
        resumed_from_step=session.resumed_from_step,
        interrupted=interrupted,
        checkpoint=os.path.join(session.run_dir, CHECKPOINT_FILE),
    )
    if distributed.is_rank_zero():
        plot_losses(os.path.join(session.run_dir, PLOT_FILE), metrics)
        write_json(os.path.join(session.run_dir, SUMMARY_FILE), summary.to_dict())
    return summary


def train(config: TrainConfig, *, progress: Callable[[StepReport], None] | None = None) -> TrainSummary:
    """Train as ``config`` says and write the run folder; see the module docstring.

    ``progress`` is called on rank 0 after every optimizer step. Raises microbatch errors for bad
    settings (before anything is written) and ResumeError for a checkpoint that cannot be resumed.

    The run draws its random numbers (dropout) from torch's global generator seeded with ``seed``
    (plus the rank) and restored afterwards, so two runs with one seed agree and the caller's
    random state is left as it was.
    """
    device = resolve_device(config.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.seed * 1000 + distributed.rank())
        return _train(config, progress=progress)


def _train(config: TrainConfig, *, progress: Callable[[StepReport], None] | None) -> TrainSummary:
    session = _setup(config)
    rank_zero = distributed.is_rank_zero()
    if rank_zero:
        write_json(os.path.join(session.run_dir, CONFIG_FILE), config.to_dict())
        write_json(os.path.join(session.run_dir, PLAN_FILE), session.plan.to_dict())
        _start_metrics(session)
        logger.info("plan: %s", session.plan)
    eval_interval, checkpoint_interval = _intervals(config)
    peak = _PeakMemory(session, every=checkpoint_interval)
    session.raw_model.train()
    tokens, started, seconds_per_step = 0, time.perf_counter(), None
    interrupted = False
    with _StopFlag().installed() as stop:
        while session.step < config.steps:
            window_started = time.perf_counter()
            # Drawn before the measurement: reading the corpus is not the step's memory.
            micro_batches = _window_batches(session, session.accumulator.window)
            with peak.measure(session.step + 1):
                stats = _run_window(session, micro_batches)
            seconds = time.perf_counter() - window_started
            session.step += 1
            tokens += stats.items
            peak_bytes = peak.last_bytes
            seconds_per_step = seconds if seconds_per_step is None else 0.9 * seconds_per_step + 0.1 * seconds
            record = {
                "step": session.step,
                "loss": stats.loss,
                "items": stats.items,
                "lr": stats.lr,
                "grad_norm": stats.grad_norm,
                "skipped": stats.skipped,
                "micro_batches": stats.micro_batches,
                "peak_bytes": peak_bytes,
                "peak_measured": peak.measured,
                "seconds": seconds,
                "tokens_per_second": stats.items / seconds if seconds > 0 else 0.0,
            }
            if session.token_steps is not None:
                record.update(session.token_steps.last_record)
            last = session.step == config.steps
            if session.step % eval_interval == 0 or last:
                record["val_loss"] = evaluate(session)
            session.metrics.append(record)
            if rank_zero:
                _append_metrics(session, record)
            stopping = stop.agreed()
            if stopping or last or session.step % checkpoint_interval == 0:
                _save(session)
            if rank_zero and progress is not None:
                progress(
                    StepReport(
                        step=session.step,
                        total_steps=config.steps,
                        loss=stats.loss,
                        lr=stats.lr,
                        tokens_per_second=record["tokens_per_second"],
                        peak_bytes=peak_bytes,
                        eta_seconds=seconds_per_step * (config.steps - session.step),
                        val_loss=record.get("val_loss"),
                    )
                )
            if stopping and not last:
                interrupted = True
                break
    if session.checkpoint_handle is not None:
        session.checkpoint_handle.remove()
    return _finish(
        session, seconds=time.perf_counter() - started, tokens=tokens, peak=peak, interrupted=interrupted
    )
