"""The run folder opened once: every write goes through its descriptor, whatever happens to its name.

A path such as ``runs/r/metrics.jsonl`` is looked up again at every write: a folder renamed mid-run
with a symbolic link (or another folder) put in its place would send every later write into the
link's target. ``O_NOFOLLOW`` guards the last name only. So the run opens its folder once, when it
claims it (ownership.py), and writes each file relative to that descriptor (``os.open(name, ...,
dir_fd=...)``, openat(2)): the writes land in the folder the run started in, wherever it is now.

``moved()`` tells whether the folder's name still leads to that folder (same device and inode); the
run checks it at every step and stops cleanly when it does not (loop.py), saying where its folder
is now. The descriptor also carries the run's exclusive ``flock`` (ownership.FolderLock): a lock on
the folder itself, which no cleanup of lock files can delete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat


def open_no_follow(path: str, flags: int, mode: int = 0o666, *, dir_fd: int | None = None) -> int:
    """os.open that refuses a symbolic link at ``path`` (ELOOP) and anything but a regular file.

    ``dir_fd``: ``path`` is a name inside the folder open as that descriptor (openat).
    """
    descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return descriptor


# flock on a folder is refused by some file systems (NFS emulates flock with fcntl locks, which
# need a file open for writing): the lock file alone then guards the run, as before.
_NO_FOLDER_LOCK = frozenset({errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP})
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN})


class PinnedFolder:
    """``path`` opened as a directory descriptor (``fd``) for the whole run; ``close()`` ends it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        status = os.fstat(self.fd)
        self.identity = (status.st_dev, status.st_ino)

    @property
    def descriptor(self) -> int:
        if self.fd is None:
            raise OSError(errno.EBADF, "the run folder is closed", self.path)
        return self.fd

    def lock(self) -> bool:
        """Take the exclusive flock on the folder itself: True; False where the file system has none.

        BlockingIOError (an OSError) when another process holds it.
        """
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in _BUSY:
                raise BlockingIOError(error.errno, "the run folder is locked", self.path) from error
            if error.errno in _NO_FOLDER_LOCK:
                return False
            raise
        return True

    def open(self, name: str, flags: int, mode: int = 0o666) -> int:
        """A regular file ``name`` inside the folder (never through a symbolic link)."""
        return open_no_follow(name, flags, mode, dir_fd=self.descriptor)

    def moved(self) -> bool:
        """True when ``path`` no longer leads to this folder (renamed, deleted, a link put there)."""
        try:
            status = os.stat(self.path)
        except OSError:
            return True
        return (status.st_dev, status.st_ino) != self.identity

    def where_now(self) -> str | None:
        """The folder's current path (Linux's /proc), None when it was deleted or cannot be told."""
        with contextlib.suppress(OSError):
            where = os.readlink(f"/proc/self/fd/{self.descriptor}")
            if not where.endswith(" (deleted)") and os.path.isdir(where):
                return where
        return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None
