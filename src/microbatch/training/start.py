"""Open the run folder: claim a new run's folder, or a resumed run's folder and its checkpoint.

Rank 0 claims the folder (ownership.py: the marker, the lock held for the whole run) before any
rank writes; the claim is in ``RunStart.claim`` and train() releases it at the end. A new run
that fails to start is ``abandon``-ed: the folder it created is removed again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Any

from .. import distributed
from ..distributed import decided_on_rank_zero
from ..errors import ConfigError, ResumeError
from ..planner import Plan
from ..profile import stash
from .config import RESUMABLE_CHANGES, TrainConfig
from .ownership import FolderClaim, claim_new_folder, claim_resumed_folder, default_run_dir
from .run_folder import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    check_writable,
    latest_run_dir,
    load_checkpoint,
    read_metrics,
    remove_stale_temporaries,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunStart:
    """Where the run lives; for a resumed run, its checkpoint and the config and plan saved in it."""

    run_dir: str
    state: dict[str, Any] | None = None
    saved_config: TrainConfig | None = None
    saved_plan: Plan | None = None
    claim: FolderClaim | None = None  # rank 0's hold on the folder (None on the other ranks)

    @property
    def saved_step(self) -> int:
        return int(self.state["step"]) if self.state is not None else 0


def open_run(config: TrainConfig) -> RunStart:
    """The new run's folder (checked), or the resumed run's checkpoint (checked against ``config``)."""
    if distributed.is_rank_zero():
        stash.remove_stale_stashes()  # planner stash files of processes killed outright (kill -9)
    claims: list[FolderClaim] = []  # rank 0's claim (decided_on_rank_zero broadcasts the folder's name only)
    if not config.resume:
        run_dir = decided_on_rank_zero(lambda: _claim_new_run(config, claims), what="naming the run folder")
        return RunStart(run_dir=run_dir, claim=claims[0] if claims else None)
    run_dir = decided_on_rank_zero(
        lambda: _claim_resumed_run(config, claims), what="finding the run to resume"
    )
    path = os.path.join(run_dir, CHECKPOINT_FILE)
    try:
        start = _resumed_start(config, run_dir, path, claims[0] if claims else None)
    except BaseException:
        for claim in claims:
            claim.release()
        raise
    return start


def _claim_resumed_run(config: TrainConfig, claims: list[FolderClaim]) -> str:
    run_dir = config.out or latest_run_dir()
    load_checkpoint(os.path.join(run_dir, CHECKPOINT_FILE))  # a microbatch checkpoint, by its contents
    claims.append(claim_resumed_folder(run_dir, has_run_checkpoint=True))
    return run_dir


def _resumed_start(config: TrainConfig, run_dir: str, path: str, claim: FolderClaim | None) -> RunStart:
    state = load_checkpoint(path)
    try:
        saved_config = TrainConfig.from_dict(state["config"])
        saved_plan = Plan.from_dict(state["plan"])
    except (KeyError, TypeError, ConfigError) as error:
        raise ResumeError(
            f"--resume: {path!r} lacks a readable config or plan ({error}); nothing was changed"
        ) from error
    _check_resume_matches(config, saved_config, path)
    if distributed.is_rank_zero():  # checked before planning: the history must match the checkpoint
        read_metrics(os.path.join(run_dir, METRICS_FILE), up_to_step=int(state["step"]), checkpoint=state)
    start = RunStart(
        run_dir=run_dir, state=state, saved_config=saved_config, saved_plan=saved_plan, claim=claim
    )
    if config.steps == start.saved_step:  # killed after its last checkpoint, before summary.json
        logger.info(
            "the run in %s has done all %d steps; writing its summary (pass --steps N to train further)",
            run_dir,
            config.steps,
        )
    if config.steps < start.saved_step:
        raise ConfigError(
            f"--steps {config.steps}: the run in {run_dir!r} has already done {start.saved_step} "
            "optimizer steps; "
            f"pass --steps greater than {start.saved_step} to train it further"
        )
    stages = max(1, config.pipeline)  # a pipelined run's plan counts data-parallel replicas
    if saved_plan.world_size * stages != distributed.world_size():
        raise ResumeError(
            f"--resume: the run was trained with {saved_plan.world_size * stages} process(es), now "
            f"{distributed.world_size()}; resume it with {saved_plan.world_size * stages}"
        )
    if distributed.is_rank_zero():
        remove_stale_temporaries(run_dir)
    return start


def _claim_new_run(config: TrainConfig, claims: list[FolderClaim]) -> str:
    """The new run's folder, created (or checked empty), locked and marked; its stale temporaries gone."""
    if config.out:
        check_writable(config.out)
        claim = claim_new_folder(config.out)
    else:
        claim = claim_new_folder(default_run_dir(config.model), created=True)
    claims.append(claim)
    remove_stale_temporaries(claim.run_dir)
    return claim.run_dir


def _check_resume_matches(config: TrainConfig, saved: TrainConfig, path: str) -> None:
    mismatched = [
        f"{f.name}={getattr(config, f.name)!r} (checkpoint: {getattr(saved, f.name)!r})"
        for f in fields(TrainConfig)
        if f.name not in RESUMABLE_CHANGES and getattr(config, f.name) != getattr(saved, f.name)
    ]
    if mismatched:
        raise ResumeError(
            f"--resume: {path!r} was written by a different run: {'; '.join(mismatched)}. "
            "Resume with the run's own settings (only --steps, --memory and the intervals may change), "
            "or start a new run with a different --out; nothing was changed"
        )
