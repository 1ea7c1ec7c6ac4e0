"""torchrun's own fault tolerance: restarted ranks resume the run; a dead peer is named, not a bug.

Under ``torchrun --max-restarts N``, when a rank dies the agent stops the others and starts every
rank again with the same command, ``TORCHELASTIC_RESTART_COUNT`` raised by one. A restarted rank
of a new run (``--out runs/NAME``, or the runs/MODEL-DATE-TIME folder this launch made: its
marker holds TORCHELASTIC_RUN_ID) finds that folder's checkpoint and resumes from it by itself
(``restarted_config``): the windows after the checkpoint run again, bitwise as before.

A rank whose peer died sees a collective fail (gloo: "Connection reset by peer", NCCL: a timeout
or an abort); ``peer_stopped`` turns that into a TrainingError saying which rank stopped (when
it ran on this machine), the last checkpoint and the resume command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
from dataclasses import replace
from typing import Any

import torch

from .. import distributed
from ..distributed import decided_on_rank_zero
from ..errors import ResumeError, TrainingError
from .config import TrainConfig
from .ownership import ELASTIC_RUN_ID, read_marker
from .run_folder import CHECKPOINT_FILE

logger = logging.getLogger(__name__)

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun has restarted this launch's ranks (0 outside torchrun)."""
    with contextlib.suppress(ValueError):
        return max(0, int(os.environ.get(RESTART_COUNT, "0")))
    return 0


def launch_run_dir(root: str = "runs") -> str | None:
    """The folder under ``root`` that this torchrun launch made (its marker holds the launch's
    TORCHELASTIC_RUN_ID) and that holds a checkpoint; the latest such, or None."""
    launch = os.environ.get(ELASTIC_RUN_ID)
    found: list[tuple[float, str]] = []
    if not launch or not os.path.isdir(root):
        return None
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        checkpoint = os.path.join(folder, CHECKPOINT_FILE)
        with contextlib.suppress(OSError, ResumeError):
            marker = read_marker(folder) if os.path.isfile(checkpoint) else None
            if marker is not None and marker.get(ELASTIC_RUN_ID) == launch:
                found.append((os.path.getmtime(checkpoint), folder))
    return max(found)[1] if found else None


def restarted_config(config: TrainConfig) -> TrainConfig:
    """``config`` as a resume of its run folder when torchrun restarted this new run's ranks and
    the folder holds a checkpoint; ``config`` unchanged otherwise. Without ``--out`` the folder is
    the one this launch made under runs/ (launch_run_dir)."""
    if config.resume or restart_count() == 0:
        return config
    if not config.out:
        made = decided_on_rank_zero(launch_run_dir, what="finding the run this launch made")
        return config if made is None else restarted_config(replace(config, out=made))
    out = config.out
    found = decided_on_rank_zero(
        lambda: os.path.isfile(os.path.join(out, "checkpoint.pt")), what="finding the run to resume"
    )
    if not found:
        return config
    logger.info("torchrun restart %d: resuming the run in %s from its last checkpoint", restart_count(), out)
    return replace(config, resume=True)


def peers() -> list[tuple[str, int]]:
    """Every rank's (host name, PID), by rank (a collective under torchrun; [] for one process)."""
    if distributed.world_size() == 1:
        return []
    gathered: list[Any] = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, [socket.gethostname(), os.getpid()])
    return [(str(item[0]), int(item[1])) for item in gathered]


def _stopped_ranks(known: list[tuple[str, int]]) -> list[int]:
    here = socket.gethostname()
    stopped = []
    for rank, (host, pid) in enumerate(known):
        if host != here or rank == distributed.rank():
            continue
        if not _running(pid):
            stopped.append(rank)
    return stopped


def _running(pid: int) -> bool:
    """False for a process that is gone or dead but not yet reaped by its launcher (a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as file:
        return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def is_peer_failure(error: BaseException) -> bool:
    """A collective that failed because another rank is gone (not a fault of this rank)."""
    if distributed.world_size() == 1 or not isinstance(error, RuntimeError):
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error)
    return any(
        words in text
        for words in ("Connection reset", "Connection closed", "Broken pipe", "gloo", "NCCL", "timed out")
    )


def peer_stopped(
    error: BaseException, *, known: list[tuple[str, int]], run_dir: str, checkpoint_step: int | None
) -> TrainingError:
    """The clear error for a collective that failed because a peer rank stopped."""
    stopped = _stopped_ranks(known)
    who = (
        f"rank {', '.join(map(str, stopped))} stopped"
        if stopped
        else "another rank stopped (its own output says why)"
    )
    saved = (
        f"the last checkpoint is step {checkpoint_step}"
        if checkpoint_step is not None
        else "no checkpoint was saved yet"
    )
    return TrainingError(
        f"{who}; {saved}; resume with: torchrun ... microbatch train --resume --out {shlex.quote(run_dir)} "
        f"(or launch with torchrun --max-restarts N to resume by itself). This rank saw: "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )
