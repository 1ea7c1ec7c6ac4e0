"""The live objects of a run (Session): model, optimizer, schedules, Accumulator, data; its checkpoints.

``build_session`` turns a config, a run folder and a Plan into a Session; ``use_plan`` applies a
(new) plan to it at a window boundary; ``save`` / ``restore`` write and read the checkpoint.
"""

from __future__ import annotations

import errno
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..accumulate.accumulator import Accumulator
from ..checkpointing.api import CheckpointHandle
from ..errors import ConfigError, ResumeError, TrainingError
from ..models.corpus import ByteBatches, load_corpus
from ..models.gpt import GPT, GPTConfig, gpt_config
from ..models.workloads import build_seeded, gpt_optimizer
from ..planner import Plan
from . import pipelined
from .config import PRECISIONS, TrainConfig, accumulation_schedule, lr_factor, scaled_hyperparameters
from .integrity import seal
from .max_tokens import TokenSteps, resolve_max_tokens
from .pinned import PinnedFolder
from .run_folder import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    METRICS_FILE,
    atomic_write,
    read_metrics,
)


@dataclass
class Session:
    """The live objects of a run, and where it stands (``step`` optimizer steps done)."""

    config: TrainConfig
    run_dir: str
    device: torch.device
    model: nn.Module  # DistributedDataParallel(raw_model) under torchrun, else raw_model
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    plan: Plan
    train_data: ByteBatches
    validation: list[dict[str, torch.Tensor]]
    autocast_dtype: torch.dtype | None
    accumulator: Accumulator | None = None
    checkpoint_handle: CheckpointHandle | None = None
    step: int = 0
    resumed_from_step: int | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    replans: int = 0
    documents: tuple[bytes, ...] = ()  # the training documents (the planner draws its own batches)
    token_steps: TokenSteps | None = (
        None  # set when micro-batches are split by tokens (training/max_tokens.py)
    )
    eval_rows: int | None = None  # validation sequences per forward after an evaluation OOM (loop.py)
    pipeline: Any = None  # a distributed.Pipeline under --pipeline S (pipelined.py); then no Accumulator
    folder: PinnedFolder | None = None  # rank 0: the run folder opened once; every write goes through it
    checkpoint_step: int | None = None  # the step of the last checkpoint in the run folder


def build_model(config: TrainConfig, device: torch.device) -> GPT:
    model_config: GPTConfig = gpt_config(config.model, dropout=config.dropout)
    model: GPT = build_seeded(lambda: GPT(model_config), config.seed)
    return model.to(device)


def _validation_batches(
    config: TrainConfig, block_size: int, micro_batch_size: int
) -> list[dict[str, torch.Tensor]]:
    # The same validation sequences at every evaluation, on every rank: a fixed seed of their own.
    corpus = load_corpus(max_bytes=config.corpus_bytes)
    source = ByteBatches(corpus.validation, block_size=block_size, seed=10_000 + config.seed)
    return [source(micro_batch_size) for _ in range(config.eval_batches)]


def build_session(
    config: TrainConfig, *, run_dir: str, device: torch.device, raw_model: GPT, plan: Plan
) -> Session:
    """Optimizer, schedules, data streams and the plan applied to ``raw_model`` (DDP under torchrun)."""
    corpus = load_corpus(max_bytes=config.corpus_bytes)
    block_size = raw_model.config.block_size
    # Each rank reads its own stream; rank r's seed is derived from the run's seed.
    seed = pipelined.data_seed(config) if config.pipeline > 1 else config.seed * 1000 + distributed.rank()
    train_data = ByteBatches(corpus.train, block_size=block_size, seed=seed)
    model: nn.Module = raw_model
    lr, weight_decay = scaled_hyperparameters(config)
    pipe = pipelined.build_pipeline(config, raw_model, plan, device) if config.pipeline > 1 else None
    if pipe is None and distributed.world_size() > 1:
        model = nn.parallel.DistributedDataParallel(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if pipe is not None:
        optimizer = pipelined.pipeline_optimizer(pipe, lr=lr, weight_decay=weight_decay)
    else:
        optimizer = gpt_optimizer(raw_model, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup_steps=config.warmup_steps, decay_steps=config.lr_decay_steps),
    )
    session = Session(
        config=config,
        run_dir=run_dir,
        device=device,
        model=model,
        raw_model=raw_model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type) if config.precision == "fp16" else None,
        plan=plan,
        train_data=train_data,
        validation=_validation_batches(config, block_size, plan.micro_batch_size),
        autocast_dtype=PRECISIONS[config.precision],
        documents=corpus.train,
        pipeline=pipe,
    )
    if pipe is None:
        use_plan(session, plan)
    return session


def use_plan(session: Session, plan: Plan) -> None:
    """Apply ``plan`` at a window boundary: its checkpointing, a fresh Accumulator at the same window.

    The checkpointing of the previous plan, if any, is removed first. Checkpointing wraps the raw
    model's blocks before DDP sees them, so DDP and the plan name the same blocks.
    """
    window = release_plan(session)
    session.checkpoint_handle = plan.checkpoint(session.raw_model)
    session.plan = plan
    config = session.config
    steps = accumulation_schedule(config, plan_steps=plan.steps, micro_batch_size=plan.micro_batch_size)
    max_tokens = resolve_max_tokens(
        config.max_tokens,
        micro_batch_size=plan.micro_batch_size,
        block_size=session.raw_model.config.block_size,
    )
    session.token_steps = TokenSteps(steps, max_tokens) if max_tokens is not None else None
    session.accumulator = Accumulator(
        session.model,
        session.optimizer,
        steps=session.token_steps or steps,
        scheduler=session.scheduler,
        max_grad_norm=config.max_grad_norm,
        scaler=session.scaler,
    )
    if window is not None:
        session.accumulator.load_state_dict(window)


def release_plan(session: Session) -> dict[str, Any] | None:
    """Remove the plan's checkpointing and the Accumulator (at a window boundary); its state."""
    state = session.accumulator.state_dict() if session.accumulator is not None else None
    if session.accumulator is not None:
        session.accumulator.close()  # its hooks go now, not when it is collected
    if session.checkpoint_handle is not None:
        session.checkpoint_handle.remove()
    session.checkpoint_handle, session.accumulator = None, None
    return state


def accumulator(session: Session) -> Accumulator:
    if session.accumulator is None:  # build_session always sets one; this narrows the type
        raise ConfigError("the session has no plan applied")
    return session.accumulator


def checkpoint_state(session: Session) -> dict[str, Any]:
    # Every rank's data stream and random state (a collective under torchrun), indexed by rank.
    rng = {"torch": torch.get_rng_state()}
    if session.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(session.device)
    mine: dict[str, Any] = {"data": session.train_data.state_dict(), "rng": rng}
    if session.pipeline is not None:  # the stages' weights into raw_model; each rank's optimizer
        pipelined.gather_model_(session.pipeline, session.raw_model)
        mine["optimizer"] = session.optimizer.state_dict()
    rank_states: list[Any] = [mine]
    if distributed.world_size() > 1:
        rank_states = [None] * distributed.world_size()
        torch.distributed.all_gather_object(rank_states, mine)
    return seal(
        {
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
            "accumulator": accumulator(session).state_dict() if session.pipeline is None else None,
            "replans": session.replans,  # so summary.json counts the whole run's re-plans after a resume
            "ranks": rank_states,
        },
        session.metrics,
    )


def restore(session: Session, state: dict[str, Any]) -> None:
    """Load a checkpoint's state into the session; ResumeError when it does not fit this run."""
    path = os.path.join(session.run_dir, CHECKPOINT_FILE)
    try:
        session.raw_model.load_state_dict(state["model"])
        rank_state = state["ranks"][distributed.rank()]
        if session.pipeline is not None:
            pipelined.scatter_model_(session.pipeline, session.raw_model)
            session.optimizer.load_state_dict(rank_state["optimizer"])
        else:
            session.optimizer.load_state_dict(state["optimizer"])
            accumulator(session).load_state_dict(state["accumulator"])
        session.scheduler.load_state_dict(state["scheduler"])
        if session.scaler is not None and state["scaler"] is not None:
            session.scaler.load_state_dict(state["scaler"])
        session.train_data.load_state_dict(rank_state["data"])
        torch.set_rng_state(rank_state["rng"]["torch"])
        if session.device.type == "cuda" and "cuda" in rank_state["rng"]:
            torch.cuda.set_rng_state(rank_state["rng"]["cuda"], session.device)
        session.step = int(state["step"])
        session.replans = int(state.get("replans", 0))
    except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as error:
        raise ResumeError(
            f"--resume: {path!r} does not match this run ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); nothing was changed"
        ) from error
    session.resumed_from_step = session.checkpoint_step = session.step
    session.metrics = read_metrics(
        os.path.join(session.run_dir, METRICS_FILE), up_to_step=session.step, checkpoint=state
    )


def save(session: Session) -> None:
    """Write the checkpoint (rank 0; a collective under torchrun). A full disk is a TrainingError."""
    state = checkpoint_state(session)  # a collective under torchrun: every rank takes part
    failure: OSError | None = None
    path = os.path.join(session.run_dir, CHECKPOINT_FILE)
    if distributed.is_rank_zero():
        try:
            atomic_write(path, lambda file: torch.save(state, file), folder=session.folder)
        except OSError as error:
            failure = error
    # Every rank waits for rank 0's write. A rank that returned at once could exit on a stop signal
    # while rank 0 is still writing; torchrun then sends rank 0 SIGTERM mid-write and the new
    # checkpoint is lost. The same all_reduce tells every rank whether the write failed.
    (failed_ranks,) = distributed.all_reduce_values([1.0 if failure is not None else 0.0])
    if failure is not None:
        raise storage_error(path, session.step, failure, saved_step=session.checkpoint_step) from failure
    if failed_ranks:
        raise TrainingError(
            f"rank 0 could not write the checkpoint at step {session.step} (its error says why); "
            "this rank stops with it"
        )
    session.checkpoint_step = session.step


def storage_error(path: str, step: int, error: OSError, *, saved_step: int | None) -> TrainingError:
    """The clear error for a run-folder write that failed (a full disk, most often).

    ``saved_step``: the step of the run's last checkpoint (None: none was saved yet).
    """
    if error.errno == errno.ENOSPC:
        reason, fix = "the disk is full", "free space (or choose another --out)"
    elif error.errno == errno.EDQUOT:
        reason, fix = "the disk quota is exhausted", "free space in your quota (or choose another --out)"
    elif error.errno in (errno.ELOOP, errno.EINVAL):  # pinned.open_no_follow's refusals
        reason = "it is now a symbolic link or not a file; microbatch writes only the run's own files"
        fix = "put the run's own file back (or choose another --out)"
    elif error.errno == errno.EFBIG:
        reason = "the file is larger than this process's file-size limit allows (EFBIG)"
        fix = "raise the limit (ulimit -f unlimited, or your scheduler's file-size limit)"
    else:
        reason, fix = error.strerror or str(error), "fix the cause (or choose another --out)"
    if saved_step is not None:
        return TrainingError(
            f"cannot write {path!r} at step {step}: {reason}. The last checkpoint (step {saved_step}) is "
            f"intact and the partial file was removed; {fix} and resume with --resume"
        )
    return TrainingError(
        f"cannot write {path!r} at step {step}: {reason}. No checkpoint was saved yet (the partial file "
        f"was removed); {fix} and start the run again"
    )


def check_folder(session: Session) -> None:
    """Rank 0: TrainingError when the run folder's name no longer leads to it (pinned.py).

    A single process saves the window's checkpoint first, into the folder it started in (wherever
    it is now); under torchrun the other ranks are told by the collective that follows.
    """
    folder = session.folder
    if folder is None or not folder.moved():
        return
    where = folder.where_now()
    if where is None:
        raise TrainingError(
            f"the run folder {folder.path!r} was deleted while the run trained (step {session.step}); "
            "nothing more can be saved. Start the run again with a new --out"
        )
    if distributed.world_size() == 1 and session.checkpoint_step != session.step:
        save(session)
    saved = (
        f"its last checkpoint is step {session.checkpoint_step}"
        if session.checkpoint_step is not None
        else "no checkpoint was saved yet"
    )
    raise TrainingError(
        f"the run folder {folder.path!r} was moved or replaced while the run trained: the run's folder is "
        f"now {where!r}. The run stopped at step {session.step} and wrote nothing through the old name; "
        f"{saved}, in {where!r}. Resume with: microbatch train --resume --out {shlex.quote(where)}"
    )
