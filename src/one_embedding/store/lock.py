"""The lock that keeps a second process out of a persistent path.

The lock is an ``fcntl.flock`` on the path's folder itself (an ``O_RDONLY`` descriptor of the
directory), not on a file inside it: a file can be deleted while it is locked, and the next
process would then create a fresh ``LOCK`` file, lock that new inode and get in beside the first
one (deleting the working files under it). The folder cannot be replaced while it holds files.
The ``LOCK`` file is still written, with the holder's pid, for the error message and for anyone
looking at the folder, and it is flock'ed too, so a process of an older version of this library
(which locked only the file) is still kept out.

The kernel releases a flock when its holder dies, so a process killed with SIGKILL leaves no
stale lock behind.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os

from ..errors import LockedError, StoreError

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"


def _try_flock(fd: int) -> bool:
    """True when ``fd`` is now locked exclusively, False when another holder has it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise
    return True


def _exited(pid: str) -> bool:
    """True when ``pid`` (as the LOCK file holds it) names no running process."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False  # a process of another user: it runs
    return False


class PathLock:
    """Held from construction until ``release()`` (or the process ends)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._dir_fd = self._fd = None
        self._pid = os.getpid()  # a forked child shares the flock: it must never unlock it
        try:
            os.makedirs(directory, exist_ok=True)
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except PermissionError as e:
            raise StoreError(
                f"persistent_path {directory!r} is not writable ({e.strerror}): "
                "choose a directory this user can write"
            ) from None
        except OSError as e:
            raise StoreError(f"cannot create the persistent path {directory!r}: {e}") from None
        try:
            if not _try_flock(self._dir_fd):
                self._refuse()
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError as e:
                raise StoreError(
                    f"persistent_path {directory!r} is not writable ({e.strerror}): "
                    "choose a directory this user can write"
                ) from None
            if not _try_flock(self._fd):
                self._refuse()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        except BaseException:
            self.release()
            raise

    def _refuse(self) -> None:
        try:
            with open(self.path, "rb") as f:
                holder = f.read(64).decode(errors="replace").strip()
        except OSError:  # the LOCK file was deleted under its holder
            holder = ""
        holder = holder or "unknown"
        if holder == str(os.getpid()):
            who = f"this process (pid {holder})"
        elif _exited(holder):
            # the lock belongs to the open file, which a process forked from the writer of the
            # pid shares: that child outlived it and holds the lock now
            who = (f"a process forked from pid {holder}, which has exited (a data-loader "
                   "worker, a multiprocessing child): end it")
        else:
            who = f"another process (pid {holder})"
        raise LockedError(
            f"persistent_path {self.directory!r} is in use by {who}: "
            "close that embedding first, or give this one another persistent_path"
        )

    def release(self) -> None:
        """Unlock and close. In a process forked from the holder, only close this process's
        descriptors: the flock belongs to the open file both share, so an unlock here released
        the holder's lock (and let another process open the path it still used)."""
        forked = os.getpid() != getattr(self, "_pid", os.getpid())
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                setattr(self, name, None)
                try:
                    if not forked:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)

    def __del__(self):
        try:
            self.release()
        except Exception as e:  # garbage collection cannot raise: the reason is logged
            log.warning("the lock of %r was not released, and releasing it at garbage "
                        "collection failed: %r", getattr(self, "directory", "?"), e)
