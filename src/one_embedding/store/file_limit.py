"""The process's limit on open files, which the slot engine's segments count against.

A live slot-engine segment keeps its rows file open (and its keys file while it is written), so
a large table needs more descriptors than the usual soft limit of 1024. The library never
changes the limit by itself (it is the whole process's, and a store is one object in it): the
application that owns the process raises it, as the CLI does on start (``raise_open_file_limit``),
and a store that runs out of descriptors raises ``StoreError`` naming the limit and the fix
(``too_many_open_files``) instead of a bare ``OSError``.
"""
from __future__ import annotations

import errno
import logging
import resource

from ..errors import StoreError

log = logging.getLogger(__name__)

#: the soft limit asked for where the hard limit is unlimited
UNLIMITED_TARGET = 1 << 20


def open_file_limit() -> int:
    """The soft limit on open files now in force."""
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def raise_open_file_limit(reason: str) -> int:
    """Lift the soft limit on open files to the hard one (``UNLIMITED_TARGET`` where that is
    unlimited) for ``reason``, which a warning names when the system refuses. Returns the soft
    limit now in force. For the owner of the process (the CLI), not for a library object."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s): %s; a store "
                        "that needs more descriptors will say so", soft, want, e, reason)
    return open_file_limit()


def too_many_open_files(path: str, error: OSError) -> StoreError | None:
    """The ``StoreError`` for ``error`` (opening ``path``) when it is EMFILE/ENFILE, else None."""
    if error.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    scope = "the process's" if error.errno == errno.EMFILE else "the system's"
    return StoreError(
        f"cannot open {path!r}: {scope} open-file limit is reached (soft limit {open_file_limit()}"
        "); each live slot-engine segment keeps a file open: raise the limit before building the "
        "store (`ulimit -n`, or one_embedding.store.file_limit.raise_open_file_limit(reason) "
        "at the start of the program, as the CLI does)")
