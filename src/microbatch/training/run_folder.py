"""The run folder: atomic writes, checkpoint files, metrics lines and the loss plot."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import ConfigError, ResumeError
from .config import TrainConfig

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


def atomic_write(path: str, write: Callable[[Any], None], *, binary: bool = True) -> None:
    """Write a file so a reader sees the old or the new content, never a part: temp, fsync, rename.

    A failed write (a full disk, a file-size limit, a quota) raises OSError with its errno, the old
    file untouched and the temporary file removed, also when the writer (torch.save) hides the
    OSError inside a RuntimeError.
    """
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    # Mode 0o666 less the umask, like any new file (mkstemp would make it private to the owner).
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete the temporary files of writes that were killed before their rename (``.NAME.*.tmp``).

    Called when a run starts or resumes, before it writes anything: no write of this run is in
    flight then, and each such file may hold a whole model. Returns the names removed.
    """
    removed = []
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if name.startswith(".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(run_dir, name))
                    removed.append(name)
    if removed:
        logger.info(
            "removed %d leftover temporary file(s) of interrupted writes in %s", len(removed), run_dir
        )
    return removed


def write_json(path: str, data: Any) -> None:
    atomic_write(path, lambda file: json.dump(data, file, indent=2, sort_keys=True), binary=False)


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


def prepare_run_dir(path: str) -> None:
    """Create the run folder and prove it is writable, or raise ConfigError naming --out."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(
            f"--out {path!r}: cannot write the run folder there ({error.strerror or error}); "
            "choose a folder you can write to"
        ) from error


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
    return state


def resume_config(run_dir: str, **changes: Any) -> TrainConfig:
    """The config saved in ``run_dir``'s checkpoint with ``changes`` (steps, ...) and resume=True."""
    state = load_checkpoint(os.path.join(run_dir, CHECKPOINT_FILE))
    saved = TrainConfig.from_dict(state["config"])
    return replace(saved, out=run_dir, resume=True, **changes)


def latest_run_dir(root: str = "runs") -> str:
    """The most recently modified folder under ``root`` that holds a checkpoint."""
    candidates = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name, CHECKPOINT_FILE)
            if os.path.isfile(path):
                candidates.append((os.path.getmtime(path), os.path.join(root, name)))
    if not candidates:
        raise ResumeError(f"--resume: no run with a checkpoint under {root!r}; pass --out runs/NAME")
    return max(candidates)[1]


def read_metrics(path: str, *, up_to_step: int) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    if os.path.isfile(path):
        with open(path) as file:
            for line in file:
                with contextlib.suppress(json.JSONDecodeError):
                    record = json.loads(line)
                    if isinstance(record, dict) and int(record.get("step", 0)) <= up_to_step:
                        lines.append(record)
    return lines


def plot_losses(path: str, metrics: list[dict[str, Any]]) -> None:
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
    atomic_write(path, lambda file: figure.savefig(file, format="png"))
