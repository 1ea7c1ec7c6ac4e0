"""Open the run folder: a new run's (checked, not created yet) or a resumed run's checkpoint.

Nothing here writes a file except the removal of temporary files left by killed writes; a run
that fails to start leaves no folder behind.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, fields
from typing import Any

from .. import distributed
from ..errors import ConfigError, ResumeError
from ..planner import Plan
from .config import RESUMABLE_CHANGES, TrainConfig
from .ranks import on_rank_zero
from .run_folder import (
    CHECKPOINT_FILE,
    check_writable,
    latest_run_dir,
    load_checkpoint,
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

    @property
    def saved_step(self) -> int:
        return int(self.state["step"]) if self.state is not None else 0


def open_run(config: TrainConfig) -> RunStart:
    """The new run's folder (checked), or the resumed run's checkpoint (checked against ``config``)."""
    if not config.resume:
        run_dir = on_rank_zero(lambda: _check_new_run(config))
        return RunStart(run_dir=run_dir)
    run_dir = on_rank_zero(lambda: config.out or latest_run_dir())
    path = os.path.join(run_dir, CHECKPOINT_FILE)
    state = load_checkpoint(path)
    try:
        saved_config = TrainConfig.from_dict(state["config"])
        saved_plan = Plan.from_dict(state["plan"])
    except (KeyError, TypeError, ConfigError) as error:
        raise ResumeError(
            f"--resume: {path!r} lacks a readable config or plan ({error}); nothing was changed"
        ) from error
    _check_resume_matches(config, saved_config, path)
    start = RunStart(run_dir=run_dir, state=state, saved_config=saved_config, saved_plan=saved_plan)
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


def _default_run_dir(config: TrainConfig) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{config.model}-{stamp}")


def _check_new_run(config: TrainConfig) -> str:
    """The new run's folder, checked but not created yet (a run that fails to start leaves nothing)."""
    run_dir = config.out or _default_run_dir(config)
    if os.path.isfile(os.path.join(run_dir, CHECKPOINT_FILE)):
        raise ConfigError(
            f"--out {run_dir!r} already holds a run; continue it with --resume, or choose another --out"
        )
    check_writable(run_dir)
    remove_stale_temporaries(run_dir)
    return run_dir


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
