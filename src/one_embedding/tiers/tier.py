"""The verbs every cache level and store implements, and the counters the chain keeps for them.

A tier holds whole lines (embedding + optimizer state, ``line_size`` float32) keyed by uint64.
The verbs say what happens on hit and miss:

- ``find(keys, out, out_rows)``: copy the line of every key held here into the caller's buffer
  (``out[out_rows[i]]``) and return the indices of the keys not held here, ready for the next
  tier. Never fills; a cache may refresh the recency of its hits.
- ``insert_or_assign(keys, lines)``: write; an evicting tier returns the whole lines it pushed
  out, which the chain writes into the tier below.
- ``export_batches()``: every (key, line) held, for flushing down and for snapshots.
- ``erase(keys)``: drop the lines of keys (an evicted feature leaves every tier).

Tiers do not count: the chain that drives them owns one ``TierCounters`` per level and counts
each call once (hits, misses, writes, evictions), whatever the tier kind.

Threads: a tier is not thread safe by itself. The chain serialises every call on a tier with
one lock; the compiled kernels behind the verbs release the GIL, so a chain call made on a
background thread overlaps with numpy / BLAS work on the main thread.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np


@dataclass
class TierCounters:
    """What one level of a chain has served: counted by the chain, once per call."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # lines this level pushed out to the level below
    writes: int = 0  # lines written into this level (puts, evictions from above, flushes)

    def __post_init__(self):
        # counts still on the device (not fields: ``as_dict`` settles them): finds whose
        # missing count, or whose number of keys (a fixed-capacity batch's live count), is a
        # 0-d device array, and writes of such a batch. Each kind sums into one 0-d int64
        # device array of its own, made (a copy) at its first count and added to in place
        # from then on: a running sum never keeps a view of a caller's array, and no sum is
        # freed after a step's add, whose memory another CUDA stream's pool could hand out
        # while that add is still queued. The chain makes every call in one device order.
        self._device: dict = {}              # kind -> 0-d int64 device running sum
        self._settled: dict = {}             # kind -> that sum's value at the last read
        self._changed: set = set()           # kinds added to since the last read
        self._host_pending = dict.fromkeys(_DEVICE_KINDS, 0)

    def _add(self, kind: str, count) -> None:
        if isinstance(count, (int, np.integer)):
            self._host_pending[kind] += int(count)
            return
        total = self._device.get(kind)
        if total is None:
            self._device[kind] = count.astype(np.int64)       # a copy, on the current stream
        else:
            total += count
        self._changed.add(kind)

    def record_find(self, queried, missing) -> None:
        """queried: an int, or a 0-d device count; missing: an int, or a 0-d device count.
        Device counts are summed on the device and read (counted) when the counters are
        (``as_dict``), not during the step."""
        if isinstance(missing, (int, np.integer)) and isinstance(queried, (int, np.integer)):
            self.hits += queried - int(missing)
            self.misses += int(missing)
            return
        self._add("queried", queried)
        self._add("missing", missing)

    def record_write(self, written, evicted: int) -> None:
        """written: an int, or a 0-d device count (read with the counters, as ``record_find``'s)."""
        if not isinstance(written, (int, np.integer)):
            self._add("written", written)
            written = 0
        self.writes += written
        self.evictions += evicted

    def as_dict(self) -> dict:
        from .. import host_sync

        counts = dict(self._host_pending)
        for kind in sorted(self._changed):
            value = int(host_sync.scalar(self._device[kind], _READS[kind]))
            counts[kind] += value - self._settled.get(kind, 0)
            self._settled[kind] = value
        self._changed.clear()
        self._host_pending = dict.fromkeys(_DEVICE_KINDS, 0)
        self.hits += counts["queried"] - counts["missing"]
        self.misses += counts["missing"]
        self.writes += counts["written"]
        return asdict(self)


_DEVICE_KINDS = ("queried", "missing", "written")
_READS = {"queried": "tier counters: device lookups", "missing": "tier counters: device misses",
          "written": "tier counters: device writes"}


def empty_lines(line_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys (0,) uint64, lines (0, line_size) float32): what a tier that evicted nothing returns."""
    return np.empty(0, np.uint64), np.empty((0, line_size), np.float32)


def all_missing(n: int) -> np.ndarray:
    """(n,) int64 ``0..n-1``: ``find``'s answer when no key is held."""
    return np.arange(n, dtype=np.int64)


class Tier(ABC):
    """One level of a chain. Subclasses set ``line_size`` and ``name``."""

    line_size: int
    name: str
    #: True for caches that push lines out when full; the bottom tier of a chain must not evict.
    evicts: bool = False

    @abstractmethod
    def find(self, keys: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64 unique; out: (N, line_size) float32, the caller's buffer;
        out_rows: (n,) int64, the row of ``out`` that receives the line of ``keys[i]``.

        Writes the line of every key held here into ``out[out_rows[i]]`` and returns
        ``missing``: (m,) int64, ascending indices ``i`` of the keys not held here. Rows of
        ``out`` for missing keys are left untouched.
        """

    @abstractmethod
    def insert_or_assign(self, keys: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64 unique, lines: (n, line_size) float32.

        Returns the evicted (keys (m,) uint64 unique, lines (m, line_size) float32); empty unless
        ``evicts``.
        """

    @abstractmethod
    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every held (keys (k,) uint64, lines (k, line_size) float32), sorted by key, in batches."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every line."""

    @abstractmethod
    def erase(self, keys: np.ndarray) -> int:
        """Drop the lines of keys (n,) uint64 (absent ones are ignored; arrays of the tier's
        module); returns how many were held. Eviction of a feature removes it from every tier."""

    @abstractmethod
    def __len__(self) -> int:
        """Lines held now."""

    @property
    def memory_bytes(self) -> int:
        return 0

    @property
    def disk_bytes(self) -> int:
        return 0

    def describe(self) -> dict:
        """What the tier holds now: name, rows, memory and disk bytes (the chain adds counters)."""
        return {"tier": self.name, "rows": len(self), "memory_bytes": self.memory_bytes,
                "disk_bytes": self.disk_bytes}

    def close(self) -> None:
        """Release files and handles; the default holds none."""


class StoreTier(Tier):
    """A bottom tier: never evicts, and writes / restores its whole state as a snapshot."""

    evicts = False

    @abstractmethod
    def save_snapshot(self, directory: str) -> dict | None:
        """Record this tier's whole state in ``directory`` (a fresh, private folder), durably.

        A store may share immutable files between its live table and its snapshots instead of
        copying them; it returns ``{relative path: {"bytes", "crc32"}}`` for files in
        ``directory`` whose checksums it already knows (the manifest then marks them shared)."""

    @abstractmethod
    def load_snapshot(self, directory: str) -> None:
        """Replace this tier's state with the one saved in ``directory``."""

    def verify_snapshot(self, directory: str, full: bool = False) -> None:
        """Raise SnapshotError unless the data the snapshot in ``directory`` refers to outside
        its own folder is intact (``full``: every byte checked). Default: it refers to none."""

    def referenced_bytes(self, directory: str) -> int:
        """Bytes of the files outside ``directory`` that the snapshot there refers to."""
        return 0

    def collect_garbage(self) -> int:
        """Delete what neither the live table nor any snapshot refers to; returns how many
        files (or file groups) went. Default: nothing to collect."""
        return 0


class ClosedTier:
    """What a chain holds in place of each tier once it is closed: every use but ``close`` raises
    ClosedError. A call that waited for the chain's lock while ``close()`` ran (a prefetch thread's
    lookup) meets it, where it met the closed store's innards (a KeyError, or an AttributeError
    on None)."""

    def __init__(self, name: str):
        self.name = name

    def close(self) -> None:
        """Closing twice is fine."""

    def __getattr__(self, attribute: str):
        from ..errors import ClosedError

        raise ClosedError(f"tier {self.name!r} is closed: its embedding was closed while this "
                          "call waited for it")

