"""Whose run folder this is, and who writes it: the marker, the lock, the folder's name.

- **The marker** ``.microbatch-run.json`` (format and version) is written when microbatch creates
  a run folder. Resume recognises a run folder by it, never by file names alone; a folder from
  before markers existed is recognised by its checkpoint's own format field (and gets a marker).
- **One writer**: the run folder itself (its descriptor, pinned.py) and ``.microbatch.lock`` hold
  an exclusive ``fcntl.flock`` for the whole run. A cleanup that deletes the lock file cannot take
  the folder's lock away, so a second writer is refused whatever happened to the file. The kernel
  drops the locks when the process ends, however it ends (kill -9 included), so there is no stale
  lock to clean; a second writer is refused at once with the holder's PID (written into the lock
  file). Under torchrun rank 0 alone claims the folder, before any rank writes (start.py).
- **A new run writes only into a folder that does not exist or is empty** (or a microbatch folder
  whose run never saved a checkpoint). A folder holding anything else is refused, naming the first
  such file, before anything is written or removed in it.
- **Default names never collide**: ``runs/MODEL-DATE-TIME`` is created with ``os.mkdir`` (atomic),
  and a name already taken gets ``-2``, ``-3``, ... (two runs started in the same second).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterable

from ..errors import ConfigError, ResumeError
from .pinned import PinnedFolder, open_no_follow

logger = logging.getLogger(__name__)

MARKER_FILE = ".microbatch-run.json"
ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"  # torchrun's id of one launch, the same across its restarts
LOCK_FILE = ".microbatch.lock"
RUN_FOLDER_FORMAT = "microbatch-run-folder"
RUN_FOLDER_VERSION = 1
MAX_MARKER_BYTES = 4096
# The files a run writes (run_folder.py's names), and the temporaries of its atomic writes.
RUN_FILES = frozenset(
    {"checkpoint.pt", "config.json", "metrics.jsonl", "plan.json", "summary.json", "loss.png"}
)
_TEMPORARY = re.compile(
    r"^\.(checkpoint\.pt|config\.json|metrics\.jsonl|plan\.json|summary\.json|loss\.png)"
    r"\.\d+\.[0-9a-f]{8}\.tmp$"
)
MAX_NAME_SUFFIX = 1000


def is_run_temporary(name: str) -> bool:
    """True for the temporary file of one of a run's own atomic writes (``.plan.json.123.ab12cd34.tmp``)."""
    return _TEMPORARY.match(name) is not None


def read_marker(run_dir: str) -> dict[str, object] | None:
    """The marker's contents; None when there is none; ResumeError when it is not one of ours."""
    path = os.path.join(run_dir, MARKER_FILE)
    try:
        descriptor = open_no_follow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ResumeError(f"{path!r} is not a microbatch run marker ({error.strerror or error})") from error
    with os.fdopen(descriptor, "rb") as file:
        raw = file.read(MAX_MARKER_BYTES + 1)
    try:
        marker = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_MARKER_BYTES else None
    except (UnicodeDecodeError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != RUN_FOLDER_FORMAT:
        raise ResumeError(f"{path!r} is not a microbatch run marker; this folder is not a microbatch run")
    version = marker.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= RUN_FOLDER_VERSION:
        raise ResumeError(
            f"{path!r}: run folder version {version!r}, this microbatch reads versions 1 to "
            f"{RUN_FOLDER_VERSION}; use the microbatch that made the run"
        )
    return marker


def write_marker(folder: PinnedFolder) -> None:
    marker = {
        "format": RUN_FOLDER_FORMAT,
        "version": RUN_FOLDER_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pid": os.getpid(),
    }
    if os.environ.get(ELASTIC_RUN_ID):  # torchrun's launch: its restarted ranks find this folder by it
        marker[ELASTIC_RUN_ID] = os.environ[ELASTIC_RUN_ID]
    descriptor = folder.open(MARKER_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(descriptor, "w") as file:
        json.dump(marker, file)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def foreign_files(names: Iterable[str], *, run_files: bool = False) -> list[str]:
    """The names in a folder that are not a run's (sorted), the run's own file names counted as
    a run's only when ``run_files`` (an unmarked folder's ``config.json`` may be the user's)."""
    ours = (RUN_FILES if run_files else frozenset()) | {MARKER_FILE, LOCK_FILE}
    return sorted(name for name in names if name not in ours and not is_run_temporary(name))


class FolderLock:
    """The exclusive flocks on ``run_dir`` itself and on ``run_dir/.microbatch.lock``.

    ``folder`` is the run folder opened once (pinned.py): the run writes through it. ``release()``
    (or process death) drops both locks.
    """

    def __init__(self, run_dir: str, *, flag: str) -> None:
        self.run_dir, self.flag = run_dir, flag
        self.descriptor: int | None = None
        try:
            self.folder = PinnedFolder(run_dir)
        except OSError as error:
            raise ConfigError(
                f"{flag} {run_dir!r}: cannot open the run folder ({error.strerror or error}); "
                f"choose another {flag}"
            ) from error
        try:
            descriptor = self._take()
        except BaseException:
            self.release()
            raise
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)

    def _take(self) -> int:
        """Lock the folder, then open and lock the lock file; its descriptor."""
        try:
            self.folder.lock()  # first: a second writer is refused before it creates any file
            self.descriptor = descriptor = self.folder.open(LOCK_FILE, os.O_RDWR | os.O_CREAT)
        except BlockingIOError as error:
            raise self._in_use() from error
        except OSError as error:
            raise ConfigError(
                f"{self.flag} {self.run_dir!r}: cannot open the run's lock file {LOCK_FILE} "
                f"({error.strerror or error}); choose another {self.flag}"
            ) from error
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise self._in_use() from error
            raise ConfigError(
                f"{self.flag} {self.run_dir!r}: cannot lock the run folder ({error.strerror or error}); "
                f"choose a folder on a file system with locks (not every network file system has them)"
            ) from error
        return descriptor

    def _in_use(self) -> ConfigError:
        holder = "unknown: its lock file was removed"
        with contextlib.suppress(OSError):
            descriptor = self.folder.open(LOCK_FILE, os.O_RDONLY)
            try:
                holder = os.pread(descriptor, 64, 0).decode("ascii", "replace").strip() or holder
            finally:
                os.close(descriptor)
        return ConfigError(
            f"{self.flag} {self.run_dir!r} is in use by another microbatch run (PID {holder}); wait for it "
            f"to end (or stop it), or choose another {self.flag}"
        )

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # closing the last descriptor drops the flock
            self.descriptor = None
        self.folder.close()


class FolderClaim:
    """A run folder this process holds: the lock, and whether this run created the folder or marker."""

    def __init__(self, run_dir: str, lock: FolderLock, *, created_dir: bool, created_marker: bool) -> None:
        self.run_dir, self.lock = run_dir, lock
        self.created_dir, self.created_marker = created_dir, created_marker

    @property
    def folder(self) -> PinnedFolder:
        return self.lock.folder

    def release(self) -> None:
        self.lock.release()

    def abandon(self) -> None:
        """A run that failed to start: remove what it created when nothing else was written, unlock."""
        with contextlib.suppress(OSError):
            left = set(os.listdir(self.run_dir)) - {MARKER_FILE, LOCK_FILE}
            if self.created_marker and not left:
                os.unlink(os.path.join(self.run_dir, MARKER_FILE))
                os.unlink(os.path.join(self.run_dir, LOCK_FILE))
                if self.created_dir:
                    os.rmdir(self.run_dir)
        self.release()


def _refuse_foreign(run_dir: str, names: list[str]) -> None:
    foreign = foreign_files(names)
    if foreign:
        raise ConfigError(
            f"--out {run_dir!r} holds files microbatch did not write (first: {foreign[0]!r}); a new run "
            "writes only into a folder that does not exist or is empty: choose another --out, or pass "
            "--resume to continue a microbatch run"
        )


def _make_folder(run_dir: str) -> bool:
    """Create ``run_dir`` (and its parents); True when this call created it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(run_dir)), exist_ok=True)
        os.mkdir(run_dir)
        return True
    except FileExistsError:
        if not os.path.isdir(run_dir):
            raise ConfigError(f"--out {run_dir!r} is a file, not a folder; choose another --out") from None
        return False
    except OSError as error:
        raise ConfigError(
            f"--out {run_dir!r}: cannot write the run folder there ({error.strerror or error}); "
            "choose a folder you can write to"
        ) from error


def claim_new_folder(run_dir: str, *, created: bool = False) -> FolderClaim:
    """Take ``run_dir`` for a new run: create it (or check it is empty or ours), lock it, mark it.

    ``created``: the caller has just created the (empty) folder (``default_run_dir``).
    """
    if os.path.isdir(run_dir):  # refused before anything is created in someone else's folder
        names = os.listdir(run_dir)
        if MARKER_FILE not in names:
            _refuse_foreign(run_dir, names)
    created_dir = _make_folder(run_dir) or created
    lock = FolderLock(run_dir, flag="--out")
    try:
        names = os.listdir(run_dir)
        marker = read_marker(run_dir)
        if marker is None:
            _refuse_foreign(run_dir, names)
        if "checkpoint.pt" in names:
            raise ConfigError(
                f"--out {run_dir!r} already holds a run; continue it with --resume, or choose another --out"
            )
        if marker is None:
            write_marker(lock.folder)
    except (ResumeError, OSError) as error:
        lock.release()
        raise ConfigError(f"--out {run_dir!r}: {error}; choose another --out") from error
    except BaseException:
        lock.release()
        raise
    return FolderClaim(run_dir, lock, created_dir=created_dir, created_marker=marker is None)


def claim_resumed_folder(run_dir: str, *, has_run_checkpoint: bool) -> FolderClaim:
    """Lock a run folder to resume it; ResumeError unless it is microbatch's.

    ``has_run_checkpoint``: the folder's checkpoint.pt is a microbatch train checkpoint (checked by
    its contents). With it, a folder made before markers existed, holding a run's files and nothing
    else, is recognised as a run folder; it is marked now.
    """
    if not os.path.isdir(run_dir):
        raise ResumeError(f"--resume: {run_dir!r} is not a folder; pass --out runs/NAME of a microbatch run")
    marker = read_marker(run_dir)
    legacy = has_run_checkpoint and not foreign_files(os.listdir(run_dir), run_files=True)
    if marker is None and not legacy:
        raise ResumeError(
            f"--resume: {run_dir!r} is not a microbatch run folder (no {MARKER_FILE}); pass the --out "
            "of a microbatch run, or start a new run without --resume"
        )
    lock = FolderLock(run_dir, flag="--out")
    if marker is None:
        try:
            write_marker(lock.folder)
        except OSError as error:
            lock.release()
            raise ResumeError(f"--resume: cannot write {MARKER_FILE} in {run_dir!r} ({error})") from error
        logger.info("marked %s as a microbatch run folder (%s)", run_dir, MARKER_FILE)
    return FolderClaim(run_dir, lock, created_dir=False, created_marker=False)


def default_run_dir(model: str, *, root: str = "runs") -> str:
    """``root/MODEL-DATE-TIME``, with ``-2``, ``-3``, ... when the name is taken; created here (atomic)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(root, f"{model}-{stamp}")
    for number in range(1, MAX_NAME_SUFFIX + 1):
        candidate = base if number == 1 else f"{base}-{number}"
        try:
            os.makedirs(root, exist_ok=True)
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as error:
            raise ConfigError(
                f"cannot create the run folder {candidate!r} ({error.strerror or error}); pass --out"
            ) from error
    raise ConfigError(f"{MAX_NAME_SUFFIX} run folders named {base!r}-N exist; pass --out")
