"""The training loop: window by window, with evaluation, checkpoints, signals and OOM recovery.

``run_windows(session, progress)`` trains from ``session.step`` up to ``config.steps``:

- each window is drawn whole, cut into the plan's micro-batches, and run by the Accumulator;
- a training-time out-of-memory error (single process) in the micro-batch loop undoes the window
  (gradients dropped, the data stream and every random state put back to the window's start),
  saves the checkpoint, re-plans without the failed configuration and runs the same window again
  (see ``_recover``); one raised once the optimizer's step began (AdamW allocating its state at
  the first step) is never retried: the step may be half made, so the run stops with a
  TrainingError and the last good checkpoint stays as it was;
- an out-of-memory error while evaluating (after the step) evaluates again in smaller pieces;
- ``config.max_skipped_windows`` skipped optimizer steps in a row stop the run (TrainingError);
- SIGINT / SIGTERM stop it at the next window boundary (signals.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from ..accumulate.accumulator import WindowStats
from ..distributed import decided_on_rank_zero
from ..errors import TrainingError, WorkloadError
from ..memory.oom import free_memory, is_out_of_memory
from ..memory.window_peaks import PeakMemory
from ..models.workloads import gpt_loss
from ..trees.batches import batch_size_of, move_batch, split_batch
from . import pipelined
from .max_tokens import split_window
from .run_folder import METRICS_FILE, append_line
from .run_plan import plan_without, planning_workload
from .session import Session, accumulator, check_folder, release_plan, save, storage_error, use_plan
from .signals import StopFlag
from .summary import StepReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How the loop ended: all steps done, or stopped by ``stopped_by`` (a signal's name)."""

    interrupted: bool
    stopped_by: str | None
    peak_source: str


def autocast(session: Session) -> contextlib.AbstractContextManager[Any]:
    if session.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(session.device.type, dtype=session.autocast_dtype)


@torch.no_grad()
def _validation_loss(session: Session, rows: int | None) -> float:
    """Token-weighted mean validation loss, each batch run in pieces of at most ``rows`` sequences."""
    total_loss: torch.Tensor | float = 0.0
    total_tokens: torch.Tensor | int = 0
    for batch in session.validation:
        size = batch_size_of(batch)
        step = size if rows is None else min(rows, size)
        for piece in split_batch(batch, [step] * (size // step) + ([size % step] if size % step else [])):
            with autocast(session):
                loss, tokens = gpt_loss(session.raw_model, move_batch(piece, session.device))
            # Summed on the device and read once at the end: no host sync per batch. A batch's mean
            # loss times its tokens is its summed loss, so pieces add up to the whole batch's sum.
            total_loss = total_loss + loss.double() * tokens
            total_tokens = total_tokens + tokens
    return float(total_loss) / max(int(total_tokens), 1)


def evaluate(session: Session) -> float:
    """Token-weighted mean validation loss over the fixed validation batches.

    Evaluation runs after the optimizer step, so running out of memory here loses nothing: the
    memory is freed and the same batches are evaluated again in pieces of half as many sequences
    (the same token-weighted mean, up to rounding), down to one sequence; the piece size that fits
    is kept for later evaluations (``session.eval_rows``). Out of memory at one sequence stops the
    run with a TrainingError after the caller saves.
    """
    if session.pipeline is not None:  # the stages' weights into raw_model (a collective)
        pipelined.gather_model_(session.pipeline, session.raw_model)
    session.raw_model.eval()
    try:
        while True:
            failed = False
            try:
                return _validation_loss(session, session.eval_rows)
            except (RuntimeError, MemoryError) as error:
                if not is_out_of_memory(error):
                    raise
                failed = True
            if failed:  # outside the handler, so the failed pieces' tensors can be freed
                free_memory(session.device)
                _halve_eval_rows(session)
    finally:
        session.raw_model.train()


def _halve_eval_rows(session: Session) -> None:
    rows = session.eval_rows or max(batch_size_of(batch) for batch in session.validation)
    if rows <= 1:
        raise TrainingError(
            f"out of memory evaluating a single validation sequence after step {session.step}; the step "
            "is saved; give the run more memory (or use a smaller --model) and resume with --resume"
        )
    session.eval_rows = rows // 2
    logger.warning(
        "out of memory while evaluating at step %d (the step itself is done); evaluating again in "
        "pieces of %d sequences",
        session.step,
        session.eval_rows,
    )


def _window_batches(session: Session) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a window, drawn at once and then cut into the plan's micro-batches.

    Drawing the whole window first makes the data independent of the split: any plan (micro-batch
    size, steps) trains on the same sequences, so plans differ only by rounding. The token ids of a
    window are small (batch x block_size int64) next to the activations of one micro-batch. They stay
    where they were drawn (the host); ``_fed`` moves each micro-batch to the device when its turn
    comes, so an accelerator holds one micro-batch's inputs, as the plan counts. (On the CPU the
    window's inputs share the training memory: the plan sets them aside, training/run_plan.py.)
    """
    acc, token_steps = accumulator(session), session.token_steps
    steps = token_steps.row_steps(acc.window) if token_steps else acc.steps_for(acc.window)
    sizes = list(session.plan.micro_batch_sizes)
    if steps != len(sizes):  # accumulation warmup: fewer, full micro-batches
        sizes = [session.plan.micro_batch_size] * steps
    window_batch = session.train_data(sum(sizes))
    if token_steps is not None:  # the same sequences, split by padded tokens instead of rows
        micro_batches = split_window(window_batch, token_steps, acc.window)
    else:
        micro_batches = split_batch(window_batch, sizes)
    return list(micro_batches)


def _fed(
    micro_batches: list[dict[str, torch.Tensor]], device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    """Each micro-batch on the device when its turn comes, dropped from the list as it goes."""
    while micro_batches:
        yield move_batch(micro_batches.pop(0), device)


def _run_window(session: Session, micro_batches: list[dict[str, torch.Tensor]]) -> WindowStats:
    acc = accumulator(session)
    stats: WindowStats | None = None
    for micro in acc.iterate(_fed(micro_batches, session.device)):
        with autocast(session):
            loss, tokens = gpt_loss(session.model, micro.batch)
        # A micro-batch of padding only (impossible with ByteBatches' lengths >= 1) still needs items >= 1.
        acc.backward(loss, items=tokens.clamp(min=1))
        if micro.is_last:
            stats = acc.step()
    if stats is None:  # iterate() always ends a window with is_last; this guards the type only
        raise WorkloadError("the training window produced no micro-batches")
    return stats


def _window_start(session: Session) -> dict[str, Any]:
    """What a window changes before its optimizer step: data stream, random states, Accumulator.

    Dropout draws from the CPU generator on CPU and from the device's generator on CUDA: both are
    kept, so the re-run draws the same masks.
    """
    return {
        "data": session.train_data.state_dict(),
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(session.device) if session.device.type == "cuda" else None,
        "accumulator": accumulator(session).state_dict(),
    }


def _restore_rng(session: Session, start: dict[str, Any]) -> None:
    torch.set_rng_state(start["rng"])
    if start["cuda_rng"] is not None:
        torch.cuda.set_rng_state(start["cuda_rng"], session.device)


def _recover(session: Session, start: dict[str, Any]) -> None:
    """Undo a window that ran out of memory before its optimizer step, save, re-plan smaller.

    The window's partial gradients are dropped and its data and random state put back, so nothing
    of it is applied; the checkpoint is saved at the window boundary (work so far is safe even if
    re-planning fails); then the plan is replaced by one without the failed configuration
    (plan.plan_without), saved again, and the same window runs again. Only a window whose
    optimizer step had not begun comes here (``_train_window``).
    """
    session.optimizer.zero_grad(set_to_none=True)
    free_memory(session.device)
    session.train_data.load_state_dict(start["data"])
    _restore_rng(session, start)
    failed = session.plan
    accumulator(session).close()  # abandoned mid-window: a fresh one at the window's start
    session.accumulator = None
    use_plan(session, failed)
    accumulator(session).load_state_dict(start["accumulator"])
    save(session)
    release_plan(session)
    workload = planning_workload(session.config, session.raw_model, session.documents, session.device)
    new_plan = decided_on_rank_zero(
        lambda: plan_without(session.config, workload, failed), what="re-planning"
    )
    use_plan(session, new_plan)
    accumulator(session).load_state_dict(start["accumulator"])
    save(session)
    session.replans += 1
    logger.warning(
        "out of memory at step %d with micro-batch %d x %d; saved, re-planned to micro-batch %d x %d, "
        "running the same window again",
        session.step + 1,
        failed.micro_batch_size,
        failed.steps,
        new_plan.micro_batch_size,
        new_plan.steps,
    )


def _train_window(session: Session, peak: PeakMemory) -> tuple[WindowStats, float]:
    """One optimizer step, run again after re-planning when it runs out of memory (single process)."""
    if session.pipeline is not None:  # --pipeline S: its own branch (no re-planning yet)
        return pipelined.train_window(session, peak)
    while True:
        started = time.perf_counter()
        start = _window_start(session)
        # Drawn before the measurement: reading the corpus is not the step's memory.
        micro_batches = _window_batches(session)
        failed = False
        try:
            with peak.measure(session.step + 1, micro_batches):
                stats = _run_window(session, micro_batches)
            return stats, time.perf_counter() - started
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error) or distributed.world_size() > 1:
                raise
            if accumulator(session).step_began:  # retry only the micro-batch loop, never a step
                raise _step_began_error(session, error) from error
            failed = True
        finally:
            del micro_batches
        if failed:  # outside the handler, so the failed window's tensors can be freed
            _recover(session, start)


def _step_began_error(session: Session, error: BaseException) -> TrainingError:
    """An out-of-memory error once the optimizer's step began: the update may be half made."""
    return TrainingError(
        f"out of memory inside the optimizer's step at step {session.step + 1} "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): the parameters and "
        "the optimizer state may be partly updated, so the window is not run again and nothing of it is "
        "saved; the last checkpoint in the run folder is as it was. Give the run more memory (or use a "
        "smaller --model, or a lighter optimizer state), then resume with --resume"
    )


def _intervals(session: Session) -> tuple[int, int]:
    config = session.config
    eval_interval = config.eval_interval or max(1, min(50, config.steps // 5))
    checkpoint_interval = config.checkpoint_interval or max(eval_interval, 50)
    return eval_interval, checkpoint_interval


def _record(session: Session, stats: WindowStats, seconds: float, peak: PeakMemory) -> dict[str, Any]:
    return {
        "step": session.step,
        "loss": stats.loss,
        "items": stats.items,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "skipped": stats.skipped,
        "micro_batches": stats.micro_batches,
        **peak.record(),
        "seconds": seconds,
        "tokens_per_second": stats.items / seconds if seconds > 0 else 0.0,
        **(session.token_steps.last_record if session.token_steps is not None else {}),
    }


def _check_skipped(session: Session) -> None:
    limit = session.config.max_skipped_windows
    recent = session.metrics[-limit:]
    if len(recent) == limit and all(record["skipped"] for record in recent):
        raise TrainingError(
            f"the last {limit} optimizer steps (to step {session.step}) were all skipped: the gradients are "
            "not finite, so the model is not training. Lower --lr, use bf16 or fp32 instead of fp16, or "
            "check the data; the last checkpoint holds the state before these steps"
        )


def _append_metrics(session: Session, record: dict[str, Any]) -> None:
    session.metrics.append(record)
    if distributed.is_rank_zero():
        path = os.path.join(session.run_dir, METRICS_FILE)
        try:
            append_line(path, json.dumps(record) + "\n", folder=session.folder)
        except OSError as error:
            check_folder(session)  # the folder deleted or moved is the cause: say that
            raise storage_error(path, session.step, error, saved_step=session.checkpoint_step) from error
        check_folder(session)


def run_windows(session: Session, *, progress: Callable[[StepReport], None] | None = None) -> Outcome:
    """Train up to ``config.steps`` optimizer steps; see the module docstring."""
    config = session.config
    eval_interval, checkpoint_interval = _intervals(session)
    peak = PeakMemory(
        session.device, model=session.raw_model, optimizer=session.optimizer, every=checkpoint_interval
    )
    session.raw_model.train()
    seconds_per_step: float | None = None
    with StopFlag().installed() as stop:
        while session.step < config.steps:
            stats, seconds = _train_window(session, peak)
            session.step += 1
            seconds_per_step = seconds if seconds_per_step is None else 0.9 * seconds_per_step + 0.1 * seconds
            record = _record(session, stats, seconds, peak)
            last = session.step == config.steps
            if session.step % eval_interval == 0 or last:
                try:
                    record["val_loss"] = evaluate(session)
                except TrainingError:  # out of memory at one sequence: keep the step, then stop
                    _append_metrics(session, record)
                    save(session)
                    raise
            _append_metrics(session, record)
            _check_skipped(session)
            stopping, signal_name = stop.agreed()
            if stopping or last or session.step % checkpoint_interval == 0:
                save(session)
            if distributed.is_rank_zero() and progress is not None:
                progress(_step_report(session, record, seconds_per_step))
            if stopping and not last:
                return Outcome(interrupted=True, stopped_by=signal_name, peak_source=peak.source)
    return Outcome(interrupted=False, stopped_by=None, peak_source=peak.source)


def _step_report(session: Session, record: dict[str, Any], seconds_per_step: float) -> StepReport:
    total = session.config.steps
    return StepReport(
        step=session.step,
        total_steps=total,
        loss=record["loss"],
        lr=record["lr"],
        tokens_per_second=record["tokens_per_second"],
        peak_bytes=record["peak_bytes"],
        eta_seconds=seconds_per_step * (total - session.step),
        val_loss=record.get("val_loss"),
        peak_step=record["peak_step"],
        peak_what=micro_batches_in_words(session),
    )


def micro_batches_in_words(session: Session) -> str:
    """What training's micro-batches are: by padded tokens, or rows of the plan's size."""
    if session.token_steps is not None:
        return f"micro-batches of <= {session.token_steps.max_tokens} tokens"
    return f"micro-batches of {session.plan.micro_batch_size} rows"
