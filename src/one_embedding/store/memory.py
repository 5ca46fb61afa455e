"""The host-memory store: a hash index over a growable rows array; it never evicts.

It is the device_mem preset's only tier (named ``device.full``: device memory is RAM on CPU) and
the store under the cache of cached_host_mem (``host.full``). ``capacity`` is a sizing hint: past
it the rows array doubles (with a warning) instead of writing out of bounds as OneFlow's full
cache does.

Snapshot: ``keys.npy`` + ``lines.npy``, sorted by key, each fsync'd; a snapshot of a table
unchanged since the last one hard-links that one's files (no second copy).
"""
from __future__ import annotations

import os
import warnings
from typing import Iterator

import numpy as np

from ..errors import CapacityError, SnapshotError
from ..tiers import HashIndex, StoreTier, empty_lines, host_arrays
from ..tiers.hash_index import copy_found_rows
from .durable import read_array, write_array


SNAPSHOT_FILES = ("keys.npy", "lines.npy")


def _reservable_rows(line_size: int) -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    return max(1024, ram // 4 // (4 * line_size))


class MemoryStore(StoreTier):
    """Every key's line in a RAM array, found through a ``HashIndex``."""

    def __init__(self, line_size: int, capacity: int | None = None, name: str = "device.full",
                 max_rows: int | None = None):
        self.line_size = int(line_size)
        self.name = name
        self.capacity = int(capacity) if capacity else None
        self.max_rows = max_rows
        # anonymous pages are mapped lazily, so reserving `capacity` rows costs nothing until rows
        # are written; a quarter of RAM bounds the reservation for optimistic capacities
        initial = min(self.capacity or 1024, _reservable_rows(self.line_size))
        self._index = HashIndex(initial)
        self._rows = host_arrays.zeros((initial, self.line_size), np.float32)
        self._warned = False
        self._writes = 0  # changes so far (puts, erases, clears, loads)
        self._saved = None  # (writes, snapshots root, {file: inode}) of the last snapshot written
        #: keys (m,) uint64 an insert found absent, while its new keys may point at rows not yet
        #: written (an interrupt there: ``_settle`` erases them, the insert did not happen)
        self._pending = None

    def _settle(self) -> None:
        """Undo the new keys of an insert that an interrupt stopped before its rows were
        written (erasing absent keys is a no-op: safe to run again)."""
        if self._pending is not None:
            self._index.erase(self._pending)
            self._pending = None

    def __len__(self) -> int:
        self._settle()
        return len(self._index)

    @property
    def memory_bytes(self) -> int:
        return self._rows.nbytes + self._index.nbytes

    def _ensure_rows(self, n_rows: int) -> None:
        if n_rows <= self._rows.shape[0]:
            return
        if self.max_rows is not None and n_rows > self.max_rows:
            raise CapacityError(
                f"{self.name} would need {n_rows} rows but max_rows={self.max_rows}: "
                "raise the capacity or use a cached store preset"
            )
        if self.capacity and n_rows > self.capacity and not self._warned:
            warnings.warn(
                f"{self.name}: {n_rows} keys exceed capacity={self.capacity}; growing the table "
                "(set capacity to the expected number of keys to avoid regrowth)",
                RuntimeWarning,
                stacklevel=5,
            )
            self._warned = True
        new = max(n_rows, 2 * self._rows.shape[0])
        if self.capacity and n_rows <= self.capacity:
            new = min(new, self.capacity)
        grown = host_arrays.zeros((new, self.line_size), np.float32)
        grown[: self._rows.shape[0]] = self._rows
        self._rows = grown

    def find(self, keys, out, out_rows):
        self._settle()
        return copy_found_rows(self._rows, self._index.find(keys), out, out_rows)

    def insert_or_assign(self, keys, lines):
        """Interrupt safety: a new key must never point at a row not yet written (zeros, or an
        erased key's row): the keys not yet held are recorded first (``_pending``) and erased
        again by the next call if an interrupt stops this one before its rows are written."""
        self._settle()
        self._writes += 1
        keys = np.ascontiguousarray(keys, np.uint64)
        absent = self._index.find(keys) < 0
        if absent.any():
            self._pending = keys[absent]
        slots, _ = self._index.find_or_insert(keys)
        self._ensure_rows(self._index.slot_limit)
        self._rows[slots] = lines
        self._pending = None
        return empty_lines(self.line_size)

    def _sorted_items(self) -> tuple[np.ndarray, np.ndarray]:
        self._settle()
        keys, slots = self._index.items()
        order = np.argsort(keys, kind="stable")  # deterministic export order
        return keys[order], slots[order]

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        keys, slots = self._sorted_items()
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[slots[start:stop]]

    def clear(self) -> None:
        self._writes += 1
        self._index.clear()
        self._pending = None

    def erase(self, keys) -> int:
        """Drop keys (n,) uint64; their rows are reused by later keys."""
        self._settle()
        self._writes += 1
        return int((self._index.erase(keys) >= 0).sum())

    # -- snapshots: keys.npy + lines.npy, sorted by key --------------------------------------
    def save_snapshot(self, directory: str) -> None:
        """keys.npy + lines.npy into ``directory``; when nothing changed since the last snapshot
        this store wrote in the same snapshots folder (a run's ``final`` right after its last
        ``step-N``), hard links to those files instead of a second copy."""
        if self._link_unchanged(directory):
            return
        keys, slots = self._sorted_items()
        # an OSError (a full disk) reaches SnapshotDirectory.save, which keeps the old snapshot
        write_array(os.path.join(directory, "keys.npy"), keys)
        write_array(os.path.join(directory, "lines.npy"), self._rows[slots])
        self._saved = (self._writes, os.path.dirname(os.path.abspath(directory)),
                       {f: os.stat(os.path.join(directory, f)).st_ino for f in SNAPSHOT_FILES})

    def _link_unchanged(self, directory: str) -> bool:
        """Link the last snapshot's files into ``directory`` if the table is unchanged since
        and they are still there (found by inode: the folder was renamed when published)."""
        if self._saved is None or self._saved[0] != self._writes:
            return False
        _, root, inodes = self._saved
        if os.path.dirname(os.path.abspath(directory)) != root:
            return False
        for entry in os.listdir(root):
            folder = os.path.join(root, entry)
            try:
                if all(os.stat(os.path.join(folder, f)).st_ino == inodes[f] for f in SNAPSHOT_FILES):
                    for f in SNAPSHOT_FILES:
                        os.link(os.path.join(folder, f), os.path.join(directory, f))
                    return True
            except OSError:  # not that folder, or a file system without hard links
                for f in SNAPSHOT_FILES:
                    if os.path.lexists(os.path.join(directory, f)):
                        os.unlink(os.path.join(directory, f))
        return False

    def load_snapshot(self, directory: str) -> None:
        keys = read_array(os.path.join(directory, "keys.npy"))
        lines = read_array(os.path.join(directory, "lines.npy"))
        if lines.shape != (keys.shape[0], self.line_size):
            raise SnapshotError(
                f"snapshot {directory!r} holds lines of shape {lines.shape}, expected "
                f"({keys.shape[0]}, {self.line_size})"
            )
        self.clear()
        self.insert_or_assign(keys, lines)
        self._saved = None
