"""A LOCK file that keeps a second process out of a persistent path.

``fcntl.flock`` is released by the kernel when the holder dies, so a process killed with SIGKILL
leaves no stale lock behind; the pid written into the file only makes the error message useful.
"""
from __future__ import annotations

import errno
import fcntl
import os

from ..errors import LockedError, StoreError


class PathLock:
    def __init__(self, directory: str):
        self.path = os.path.join(directory, "LOCK")
        try:
            os.makedirs(directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise StoreError(
                f"persistent_path {directory!r} is not writable ({e.strerror}): "
                "choose a directory this user can write"
            ) from None
        except OSError as e:
            raise StoreError(f"cannot create the persistent path {directory!r}: {e}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                who = "this process" if holder == str(os.getpid()) else "another process"
                raise LockedError(
                    f"persistent_path {directory!r} is in use by {who} (pid {holder}): "
                    "close that embedding first, or give this one another persistent_path"
                ) from None
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass
