"""``train(config)``: the run from top to bottom, each step its own function or module.

validate_config         config.py     refuse settings a run cannot use, before anything is written
open_run                start.py      a new run folder (checked), or the checkpoint to resume
plan_for_run            run_plan.py   the Plan: planner / --micro-batch / --plan; rank 0 only
build_session           session.py    model, optimizer, schedules, data, the plan applied
run_windows             loop.py       train window by window; signals, OOM recovery, checkpoints
finish                  (here)        loss.png and summary.json for the whole run
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

import torch

from .. import distributed
from ..memory.window_peaks import worst_window
from ..models.corpus import load_corpus
from . import elastic, pipelined
from .config import TrainConfig, validate_config
from .loop import Outcome, run_windows
from .run_folder import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    METRICS_FILE,
    PLAN_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    atomic_write,
    plot_losses,
    write_json,
)
from .run_plan import PlanProgress, plan_for_run, planning_workload, resolve_device
from .session import Session, build_model, build_session, check_folder, restore, storage_error
from .signals import exit_on_stop_signals
from .start import RunStart, open_run
from .summary import StepReport, TrainSummary, whole_run_totals

logger = logging.getLogger(__name__)


def train(
    config: TrainConfig,
    *,
    progress: Callable[[StepReport], None] | None = None,
    plan_progress: PlanProgress | None = None,
) -> TrainSummary:
    """Train as ``config`` says and write the run folder (see microbatch.training).

    ``progress`` is called on rank 0 after every optimizer step; ``plan_progress(what, done, total)``
    while the planner profiles and proves the plan (rank 0, before the first step). Raises
    microbatch errors for bad settings (before anything is written) and ResumeError for a
    checkpoint that cannot be resumed.

    The run draws its random numbers (dropout) from torch's global generator seeded with ``seed``
    (plus the rank) and restored afterwards, so two runs with one seed agree and the caller's
    random state is left as it was.
    """
    validate_config(config)
    config = elastic.restarted_config(config)  # torchrun restarted the ranks: resume the run
    device = resolve_device(config.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.seed * 1000 + distributed.rank())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = open_run(config)
        try:
            return _train_in(config, start, device, progress, plan_progress)
        finally:
            if start.claim is not None:  # the folder's lock, held since open_run (rank 0)
                start.claim.release()


def _train_in(
    config: TrainConfig,
    start: RunStart,
    device: torch.device,
    progress: Callable[[StepReport], None] | None,
    plan_progress: PlanProgress | None = None,
) -> TrainSummary:
    try:
        with exit_on_stop_signals():  # a stop signal while planning cleans up (signals.py)
            session = _start_session(config, start, device, plan_progress)
    except BaseException:
        if start.claim is not None and start.state is None:  # a new run that cannot start leaves nothing
            start.claim.abandon()
        raise
    known = elastic.peers()  # every rank's host and PID, to name a rank that stops
    try:
        outcome = run_windows(session, progress=progress)
    except RuntimeError as error:
        if not elastic.is_peer_failure(error):
            raise
        raise elastic.peer_stopped(
            error, known=known, run_dir=session.run_dir, checkpoint_step=session.checkpoint_step
        ) from error
    finally:
        if session.checkpoint_handle is not None:  # the caller's model is plain again
            session.checkpoint_handle.remove()
            session.checkpoint_handle = None
    return finish(session, outcome)


def _start_session(
    config: TrainConfig, start: RunStart, device: torch.device, plan_progress: PlanProgress | None = None
) -> Session:
    """Plan (rank 0; the others receive the plan), create the run folder, build or restore the session."""
    raw_model = build_model(config, device)
    documents = load_corpus(max_bytes=config.corpus_bytes).train
    workload = planning_workload(config, raw_model, documents, device)
    if config.pipeline > 1:  # the same plan on every rank: manual, loaded, or planned on the ranks
        plan = pipelined.pipeline_plan(config, workload, device, start, plan_progress)
    else:
        plan = distributed.decided_on_rank_zero(
            lambda: plan_for_run(
                config,
                workload,
                saved=start.saved_plan,
                saved_config=start.saved_config,
                progress=plan_progress,
            ),
            what="planning",
        )
    raw_model.zero_grad(set_to_none=True)
    session = build_session(config, run_dir=start.run_dir, device=device, raw_model=raw_model, plan=plan)
    session.folder = start.claim.folder if start.claim is not None else None
    if start.state is not None:
        restore(session, start.state)
    if distributed.is_rank_zero():
        folder = session.folder
        write_json(os.path.join(session.run_dir, CONFIG_FILE), config.to_dict(), folder=folder)
        plan_text = session.plan.to_json()
        atomic_write(
            os.path.join(session.run_dir, PLAN_FILE),
            lambda file: file.write(plan_text),
            binary=False,
            folder=folder,
        )
        # metrics.jsonl as of the checkpoint: empty for a new run; a resumed run drops later lines.
        text = "".join(json.dumps(record) + "\n" for record in session.metrics)
        atomic_write(
            os.path.join(session.run_dir, METRICS_FILE),
            lambda file: file.write(text),
            binary=False,
            folder=folder,
        )
        logger.info("plan: %s", session.plan.headline())
    return session


def finish(session: Session, outcome: Outcome) -> TrainSummary:
    """The summary of the whole run (every segment since step 1); rank 0 writes it and loss.png."""
    totals = whole_run_totals(session.metrics)
    summary = TrainSummary(
        run_dir=session.run_dir,
        model=session.config.model,
        steps_done=session.step,
        total_steps=session.config.steps,
        peak_bytes_source=outcome.peak_source,
        parameters=session.raw_model.num_parameters(),
        device=str(session.device),
        plan=session.plan.to_dict(),
        resumed_from_step=session.resumed_from_step,
        interrupted=outcome.interrupted,
        checkpoint=os.path.join(session.run_dir, CHECKPOINT_FILE),
        stopped_by=outcome.stopped_by,
        replans=session.replans,
        **totals,
        **worst_window(session.metrics, session.plan.budget_bytes),
    )
    if distributed.is_rank_zero():
        check_folder(session)
        try:
            plot_losses(os.path.join(session.run_dir, PLOT_FILE), session.metrics, folder=session.folder)
            write_json(os.path.join(session.run_dir, SUMMARY_FILE), summary.to_dict(), folder=session.folder)
        except OSError as error:
            raise storage_error(
                session.run_dir, session.step, error, saved_step=session.checkpoint_step
            ) from error
    return summary
