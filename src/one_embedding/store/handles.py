"""Bounded handles on the slot engine's segment files: descriptors and mappings opened on demand.

A table of terabytes has tens of thousands of segments. Holding each one's rows file open and
its keys and checksums mapped would take three descriptors (Python's mmap keeps one) and two
mappings a segment: past the process's descriptor limit and Linux's ``vm.max_map_count``
(65530 by default) at ~2 TB. So a ``HandleBudget`` keeps at most ``max_files`` rows files open
and ``max_maps`` files mapped (by default a quarter of the descriptor limit each, which the
store leaves as it found it, and a quarter of ``vm.max_map_count``), closes the least recently
used beyond that, and opens a handle again on its next use. That costs: lookups spread over
391 segments with a budget of 16 files and 32 mappings ran at 22-24 k rows/s against 45-57 k with
every segment's handles kept (O_DIRECT, 2 cores, 2026-11-26), so a table of more segments
than a quarter of ``ulimit -n`` wants a higher limit (``ulimit -n`` before starting).

``MappedWords`` is one such mapping, and it checks the file's size before each use: a file that
another process truncated under a mapping would kill this one with SIGBUS at the first touch of
a page past its new end, so a short file is a StoreError naming it instead (only a truncation
within the microseconds between that check and the copy can still fault).

Threads: a store's calls run one at a time (the chain's lock), so the budget takes no lock.
"""
from __future__ import annotations

import os
import resource

import numpy as np

from ..errors import StoreError

#: rows files a pool keeps open at most (per store; a read holds every file it touches open),
#: and never more than a quarter of the process's descriptor limit
MAX_OPEN_FILES = 1 << 16
#: keys and checksum files a pool keeps mapped at most (per store), and never more than a
#: quarter of the descriptor limit (Python's mmap holds a descriptor of its file) nor of
#: ``vm.max_map_count``
MAX_MAPS = 1 << 16


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux: no such limit to keep under
        return 1 << 30


def short_file_error(path: str, size: int, needed: int) -> StoreError:
    return StoreError(
        f"segment file {path!r} has {size} bytes, shorter than the {needed} this store holds "
        "of it: another process truncated it (or the disk lost data); load another snapshot "
        "(one-embedding inspect lists the intact ones)")


class HandleBudget:
    """At most ``max_files`` open descriptors and ``max_maps`` mappings over the handles that
    register here, the least recently used closed first (``opened`` / ``used`` keep the order)."""

    def __init__(self, max_files: int | None = None, max_maps: int | None = None):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = 1 << 30 if soft == resource.RLIM_INFINITY else soft
        self.max_files = int(max_files if max_files is not None
                             else max(4, min(MAX_OPEN_FILES, soft // 4)))
        self.max_maps = int(max_maps if max_maps is not None
                            else max(4, min(MAX_MAPS, soft // 4, _max_map_count() // 4)))
        self._files: dict = {}  # id(holder) -> holder with an open descriptor, oldest first
        self._maps: dict = {}   # id(MappedWords) -> it, while mapped, oldest first

    @property
    def open_files(self) -> int:
        return len(self._files)

    @property
    def open_maps(self) -> int:
        return len(self._maps)

    def file_used(self, holders) -> None:
        """``holders`` (each with ``close_fd()``) have an open descriptor and are in use now:
        they become the most recent; older ones beyond ``max_files`` are closed (never one of
        ``holders``, which a read needs together)."""
        for h in holders:
            self._files.pop(id(h), None)
            self._files[id(h)] = h
        current = {id(h) for h in holders}
        while len(self._files) > self.max_files:
            oldest = next(iter(self._files))
            if oldest in current:
                break
            self._files.pop(oldest).close_fd()

    def file_closed(self, holder) -> None:
        self._files.pop(id(holder), None)

    def map_used(self, mapped: "MappedWords") -> None:
        self._maps.pop(id(mapped), None)
        self._maps[id(mapped)] = mapped
        while len(self._maps) > self.max_maps:
            oldest = next(iter(self._maps))
            if oldest == id(mapped):
                break
            self._maps.pop(oldest).unmap()

    def map_closed(self, mapped: "MappedWords") -> None:
        self._maps.pop(id(mapped), None)


class MappedWords:
    """The first ``n`` uint64 of the file ``path``, mapped read-only (page cache, not process
    RAM) while in use: ``array()`` maps it if needed (counted by ``budget``) and checks first
    that the file still holds them."""

    def __init__(self, path: str, n: int, budget: HandleBudget | None = None):
        self.path, self.n, self.budget = path, int(n), budget
        self._array: np.ndarray | None = None
        self._inode = None

    def array(self) -> np.ndarray:
        """(n,) uint64, read-only."""
        if self.n == 0:
            return np.empty(0, np.uint64)
        st = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._array is None:  # unlinked and not mapped: nothing left to read
                raise StoreError(f"segment file {self.path!r} is gone: another process deleted "
                                 "it; load another snapshot") from None
        if st is not None and st.st_size < 8 * self.n and \
                (self._array is None or (st.st_dev, st.st_ino) == self._inode):
            raise short_file_error(self.path, st.st_size, 8 * self.n)
        if self._array is None:
            self._array = np.memmap(self.path, np.uint64, "r", shape=(self.n,))
            self._inode = (st.st_dev, st.st_ino)
        if self.budget is not None:
            self.budget.map_used(self)
        return self._array

    def unmap(self) -> None:
        """Drop the mapping (unmapped once no view of it is left); ``array()`` maps it again."""
        self._array = None
        if self.budget is not None:
            self.budget.map_closed(self)

    @property
    def mapped(self) -> bool:
        return self._array is not None
