"""A place numba can write its compiled kernels to, found before numba is imported.

The kernels are compiled with ``cache=True``; numba keeps them beside the source
(``__pycache__``), else in the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``), and
raises at decoration time, that is at ``import one_embedding``, where it can write to neither: a
package installed read-only (a system site-packages, a container image) run by a user without a
writable home (a service account, ``HOME=/nonexistent``). Then the cache goes to a folder of
this user's in the temporary folder. ``NUMBA_CACHE_DIR``, when set, is always left as it is.
"""
from __future__ import annotations

import os
import sys
import tempfile


def _writable(folder: str) -> bool:
    """Whether ``folder`` can be written, or made: the nearest path above it that exists is a
    folder that can be written."""
    while not os.path.isdir(folder):
        if os.path.lexists(folder):   # a file where the folder would go
            return False
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent
    return os.access(folder, os.W_OK | os.X_OK)


def user_cache_folder() -> str:
    """Where numba's user-wide cache goes: ``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba")


def ensure_writable_numba_cache(package_folder: str | None = None) -> str | None:
    """Set ``NUMBA_CACHE_DIR`` to ``<tmp>/one_embedding-numba-<uid>`` where numba could write
    neither beside ``package_folder`` (default: this package's) nor to the user's cache folder;
    returns the folder set, or None (nothing changed: set already, numba imported already, or a
    place numba can write)."""
    if os.environ.get("NUMBA_CACHE_DIR") or "numba" in sys.modules:
        return None
    here = package_folder or os.path.dirname(os.path.abspath(__file__))
    if _writable(os.path.join(here, "__pycache__")) or _writable(user_cache_folder()):
        return None
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"one_embedding-numba-{uid}")
    os.environ["NUMBA_CACHE_DIR"] = folder
    return folder
