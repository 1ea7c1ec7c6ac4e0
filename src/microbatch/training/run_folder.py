"""The run folder: atomic writes, checkpoint files, metrics lines and the loss plot."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import ConfigError, ResumeError
from .config import TrainConfig
from .integrity import checksum_problem, metrics_problem
from .ownership import MARKER_FILE, foreign_files, is_run_temporary
from .pinned import PinnedFolder, open_no_follow

logger = logging.getLogger(__name__)

CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE = "checkpoint.pt", "config.json", "metrics.jsonl"
PLAN_FILE, SUMMARY_FILE, PLOT_FILE = "plan.json", "summary.json", "loss.png"
CHECKPOINT_FORMAT = "microbatch-train-checkpoint"
CHECKPOINT_VERSION = 2  # 2: the plan is a microbatch.planner.Plan


# --------------------------------------------------------------------------------------------------
# Run folder and checkpoints


def _fsync_directory(path: str) -> None:
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class _RecordingWriter:
    """A binary file's ``write`` that remembers the OSError it raised.

    torch.save writes through C++ (PyTorchFileWriter), which turns a failed write (ENOSPC, EFBIG
    under a file-size limit, EDQUOT) into a RuntimeError such as "unexpected pos 187968 vs 187856"
    that names neither the file nor the cause; the recorded OSError is raised in its place.
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.file.write(data))
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def atomic_write(
    path: str, write: Callable[[Any], None], *, binary: bool = True, folder: PinnedFolder | None = None
) -> None:
    """Write a file so a reader sees the old or the new content, never a part: temp, fsync, rename.

    A failed write (a full disk, a file-size limit, a quota) raises OSError with its errno, the old
    file untouched and the temporary file removed, also when the writer (torch.save) hides the
    OSError inside a RuntimeError. ``folder``: the run folder opened once (pinned.py); the file is
    written into it by ``path``'s last name, wherever the folder is now.
    """
    name = os.path.basename(path)
    dir_fd = folder.descriptor if folder is not None else None
    directory = os.path.dirname(os.path.abspath(path))
    temporary = f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    if dir_fd is None:
        temporary, name = os.path.join(directory, temporary), path
    # Mode 0o666 less the umask, like any new file (mkstemp would make it private to the owner).
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    try:
        with os.fdopen(descriptor, "wb" if binary else "w") as file:
            recorder = _RecordingWriter(file)
            try:
                write(recorder if binary else file)
            except RuntimeError as error:
                if recorder.error is None:
                    raise
                raise recorder.error from error
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    if dir_fd is not None:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    else:
        _fsync_directory(directory)


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete the temporary files of writes that were killed before their rename (``.NAME.*.tmp``).

    Called when a run starts or resumes, holding the folder's lock (ownership.py), before it writes
    anything: no write of any run is in flight then, and each such file may hold a whole model.
    Returns the names removed.
    """
    removed = []
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if is_run_temporary(name):  # only ours: a user's own .tmp files are not touched
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(run_dir, name))
                    removed.append(name)
    if removed:
        logger.info(
            "removed %d leftover temporary file(s) of interrupted writes in %s", len(removed), run_dir
        )
    return removed


def write_json(path: str, data: Any, *, folder: PinnedFolder | None = None) -> None:
    atomic_write(
        path, lambda file: json.dump(data, file, indent=2, sort_keys=True), binary=False, folder=folder
    )


def check_writable(path: str) -> None:
    """Raise ConfigError naming --out unless ``path`` is, or can be made as, a writable folder."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not os.path.isdir(existing) else "is not writable"
        raise ConfigError(
            f"--out {path!r}: cannot write the run folder there ({existing!r} {what}); "
            "choose a folder you can write to"
        )


def load_checkpoint(path: str) -> dict[str, Any]:
    """A training checkpoint's contents, or ResumeError saying what is wrong with the file."""
    if not os.path.isfile(path):
        raise ResumeError(f"--resume: no checkpoint at {path!r}; start a new run without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many types for a damaged file
        # torch's own message may advise weights_only=False: never pass that on (it runs arbitrary code).
        first_line = str(error).splitlines()[0] if str(error) else ""
        detail = "" if "weights_only" in str(error) else f" ({type(error).__name__}: {first_line})"
        raise ResumeError(
            f"--resume: the checkpoint {path!r} is corrupted or not a microbatch checkpoint{detail}; "
            "nothing was changed; start a new run with a different --out"
        ) from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ResumeError(f"--resume: {path!r} is not a microbatch train checkpoint; nothing was changed")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ResumeError(
            f"--resume: {path!r} has checkpoint version {state.get('version')!r}, this microbatch reads "
            f"version {CHECKPOINT_VERSION}; nothing was changed"
        )
    _check_checkpoint_fields(state, path)
    problem = checksum_problem(state)
    if problem is not None:
        raise ResumeError(
            f"--resume: the checkpoint {path!r} is damaged: {problem}; nothing was changed. Restore the "
            "file from a copy, or start a new run with a different --out"
        )
    return state


_CHECKPOINT_DICTS = ("config", "model_config", "plan", "model", "optimizer", "scheduler", "accumulator")


def _check_checkpoint_fields(state: dict[str, Any], path: str) -> None:
    """The checkpoint's fields have the types a resume reads (the values are checked where loaded)."""
    problem = None
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problem = f"step {step!r} is not a non-negative integer"
    config = state.get("config")
    stages = config.get("pipeline") if isinstance(config, dict) else None
    pipelined = isinstance(stages, int) and stages > 1
    for name in _CHECKPOINT_DICTS:
        if name == "accumulator" and pipelined and state.get(name) is None:
            continue  # a pipeline run steps through its Pipeline, not an Accumulator
        if problem is None and not isinstance(state.get(name), dict):
            problem = f"{name} is {type(state.get(name)).__name__}, not a dict"
    ranks = state.get("ranks")
    if problem is None and (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(rank, dict) and {"data", "rng"} <= rank.keys() for rank in ranks)
    ):
        problem = "ranks is not a list of per-rank data and random states"
    if problem is not None:
        raise ResumeError(
            f"--resume: the checkpoint {path!r} is damaged: {problem}; nothing was changed; "
            "start a new run with a different --out"
        )


def resume_config(run_dir: str, **changes: Any) -> TrainConfig:
    """The config saved in ``run_dir``'s checkpoint with ``changes`` (steps, ...) and resume=True."""
    state = load_checkpoint(os.path.join(run_dir, CHECKPOINT_FILE))
    saved = TrainConfig.from_dict(state["config"])
    return replace(saved, out=run_dir, resume=True, **changes)


def _looks_like_run(folder: str) -> bool:
    """A checkpoint and the marker (or, for a folder made before markers, only a run's own files)."""
    with contextlib.suppress(OSError):
        names = os.listdir(folder)
        return CHECKPOINT_FILE in names and (MARKER_FILE in names or not foreign_files(names, run_files=True))
    return False


def latest_run_dir(root: str = "runs") -> str:
    """The most recently modified run folder (ownership.py's marker) under ``root`` with a checkpoint."""
    candidates = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name, CHECKPOINT_FILE)
            if os.path.isfile(path) and _looks_like_run(os.path.join(root, name)):
                candidates.append((os.path.getmtime(path), os.path.join(root, name)))
    if not candidates:
        raise ResumeError(f"--resume: no run with a checkpoint under {root!r}; pass --out runs/NAME")
    return max(candidates)[1]


# The fields of a metrics line that resuming reads back (loop.py's _record writes them all).
_METRICS_NUMBERS = ("loss", "items", "peak_bytes", "seconds")
_METRICS_COUNTS = ("items", "peak_bytes", "seconds")
MAX_METRICS_LINE_BYTES = 1 << 20


def append_line(path: str, line: str, *, folder: PinnedFolder | None = None) -> None:
    """Append ``line`` to the run's file at ``path`` (by its last name inside ``folder`` when given);
    never through a symbolic link (OSError ELOOP)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    if folder is not None:
        descriptor = folder.open(os.path.basename(path), flags)
    else:
        descriptor = open_no_follow(path, flags)
    with os.fdopen(descriptor, "w") as file:
        file.write(line)


def _metrics_record(raw: bytes, where: str) -> dict[str, Any]:
    """One metrics line parsed and checked; ResumeError naming the line and what is wrong."""
    try:
        record = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_METRICS_LINE_BYTES else None
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ResumeError(f"{where} is not a JSON line ({type(error).__name__})") from error
    if not isinstance(record, dict):
        raise ResumeError(f"{where} is not a metrics record (a JSON object of at most 1 MiB)")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ResumeError(f"{where}: step {step!r} is not a positive integer")
    for name in _METRICS_NUMBERS:
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ResumeError(f"{where}: {name} {value!r} is not a number")
        if name in _METRICS_COUNTS and not (math.isfinite(value) and value >= 0):
            raise ResumeError(f"{where}: {name} {value!r} is not a non-negative count")
    rate, items, seconds = record.get("tokens_per_second"), record["items"], record["seconds"]
    if rate is not None and not math.isclose(rate, items / seconds if seconds > 0 else 0.0, rel_tol=1e-9):
        raise ResumeError(f"{where}: tokens_per_second {rate!r} is not items / seconds ({items} / {seconds})")
    if not isinstance(record.get("skipped"), bool):
        raise ResumeError(f"{where}: skipped {record.get('skipped')!r} is not true or false")
    return record


def read_metrics(
    path: str, *, up_to_step: int, checkpoint: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """metrics.jsonl's records of steps 1 to ``up_to_step`` (the checkpoint's), checked against it.

    The checkpoint at step N is written after the line of step N, so the file holds one line per
    step 1..N in order, then perhaps lines of steps the checkpoint does not cover (they are dropped:
    those steps run again) and perhaps a last line cut short by a kill (dropped too). Anything else
    (a line missing, duplicated, out of order or malformed; the file missing) is a ResumeError
    naming the line: the run's history and its checkpoint disagree; so are records with negative
    counts, and lines that do not match the checksum ``checkpoint`` saved of them (integrity.py).
    """
    if up_to_step == 0 and not os.path.lexists(path):
        return []
    try:
        descriptor = open_no_follow(path, os.O_RDONLY)
        with os.fdopen(descriptor, "rb") as file:
            raw_lines = file.read().split(b"\n")
    except OSError as error:
        raise _metrics_mismatch(path, up_to_step, f"it cannot be read ({error.strerror or error})") from error
    last_cut_short = raw_lines[-1] != b""  # a kill during the append leaves a line with no newline
    records: list[dict[str, Any]] = []
    for number, raw in enumerate(raw_lines[:-1] if not last_cut_short else raw_lines, start=1):
        try:
            record = _metrics_record(raw, f"line {number}")
        except ResumeError as error:
            if last_cut_short and number == len(raw_lines):
                break
            raise _metrics_mismatch(path, up_to_step, str(error)) from error
        if record["step"] > up_to_step:
            continue
        if record["step"] != len(records) + 1:
            raise _metrics_mismatch(
                path, up_to_step, f"line {number} is step {record['step']}, step {len(records) + 1} expected"
            )
        records.append(record)
    if len(records) != up_to_step:
        raise _metrics_mismatch(path, up_to_step, f"it holds steps 1 to {len(records)} only")
    problem = metrics_problem(checkpoint, records) if checkpoint is not None else None
    if problem is not None:
        raise _metrics_mismatch(path, up_to_step, problem)
    return records


def _metrics_mismatch(path: str, up_to_step: int, what: str) -> ResumeError:
    return ResumeError(
        f"--resume: {path!r} does not match the checkpoint, which covers steps 1 to {up_to_step}: {what}. "
        "Restore the file (one line per step), or start a new run with another --out; nothing was changed"
    )


def plot_losses(path: str, metrics: list[dict[str, Any]], *, folder: PinnedFolder | None = None) -> None:
    """loss.png: training loss per step and validation loss where it was measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [record["step"] for record in metrics]
    axes.plot(steps, [record["loss"] for record in metrics], label="training loss", linewidth=1)
    validation = [
        (record["step"], record["val_loss"]) for record in metrics if record.get("val_loss") is not None
    ]
    if validation:
        axes.plot(*zip(*validation, strict=True), "o-", label="validation loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (nats per byte)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    atomic_write(path, lambda file: figure.savefig(file, format="png"), folder=folder)
