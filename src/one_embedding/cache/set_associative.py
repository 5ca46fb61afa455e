"""Set-associative caches with "lru" and "lfu" replacement, as the GPU cache runs them.

``n_sets`` sets of ``ways`` ways. A key lives only in set ``mix64(key) % n_sets``
(``hashing.mix64``, the splitmix64 finalizer); its ways are scanned linearly. A touch (a ``find``
hit or an ``insert_or_assign``) sets the way's stamp to a clock that advances by one per touch, so
stamps are unique and the order is deterministic. The victim of a full set is the way with the
smallest stamp (LRU) or the smallest (freq, stamp) (LFU: least frequent, least recent among
equals).

Memory grows with the lines held, not with the budget. A set gets its block of ways when its
first line arrives, and a way gets its row of ``rows`` when it first holds a line; both are
handed out in order from arrays sized for the whole budget but never touched beyond what is
used (anonymous memory is backed page by page on first write). Indexing a budget-sized array by
set instead would back a page, or a 2 MiB transparent huge page, for every scattered key:
measured, an 8,192 MB budget holding 50k keys took 8.7-9.9 GB of RAM that way. ::

    set_block  (n_sets,) int64           block of the set, -1 until its first line
    way_keys   (n_sets, ways) uint64     per block: key held by the way
    way_used   (n_sets, ways) bool       per block: the way holds a line
    way_stamp  (n_sets, ways) int64      per block: clock of the last touch
    way_freq   (n_sets, ways) int64      per block: touches since the line came in (LFU only)
    way_row    (n_sets, ways) int64      per block: row of ``rows`` holding the way's line
    way_dirty  (n_sets, ways) bool       per block: the line is newer than the copy below
    rows       (n_sets * ways, line_size) float32
    alloc      (2,) int64                blocks and rows handed out so far

Where a line sits in memory does not change which set or way it belongs to, so hits, victims and
evictions are exactly those of a cache indexed by set.

A written line is *dirty*; ``flush_batches`` hands the dirty lines to the level below and marks
them clean once it has them (a snapshot's flush). A clean line has an identical copy lower down,
so evicting it writes nothing, and the next snapshot's flush writes only what changed since the
last one, not the whole cache again.

``find`` never fills. ``insert_or_assign`` writes every key into the cache, in batch order; the
line a new key displaces is copied out before it is overwritten and returned for the next tier
(once per key: a resident evicted early in the batch, then written and evicted again, leaves with
its newer line only). A batch bigger than a set's ways (or than the whole cache) therefore
*spills*: keys of the same batch evict each other and the evicted ones, carrying their new lines,
go down a level. Nothing is lost, so no batch is too big; only a budget below one row raises
``CapacityError``.

The probing and bookkeeping are numba kernels at module level, written as the per-set loops a
CUDA version runs with one warp per set.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
from numba import njit

from ..errors import CapacityError, ConfigError
from ..hashing import jit_mix64
from ..tiers import Tier, empty_lines, host_arrays

POLICIES = ("lru", "lfu")
_LRU, _LFU = 0, 1


@njit(cache=True, nogil=True)
def _find(set_block, way_keys, way_used, way_stamp, way_freq, way_row, way_dirty, rows, keys,
          clock, out, out_rows, missing):
    """out[out_rows[i]] = line of keys[i] for every hit (touched); misses go to ``missing``.

    Returns (clock, n_missing).
    """
    n_sets = set_block.shape[0]
    ways = way_keys.shape[1]
    n_missing = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        b = set_block[np.int64(jit_mix64(k) % np.uint64(n_sets))]
        hit = -1
        if b >= 0:
            for w in range(ways):
                if way_used[b, w] and way_keys[b, w] == k:
                    way_stamp[b, w] = clock
                    way_freq[b, w] += 1
                    clock += 1
                    hit = way_row[b, w]
                    break
        if hit < 0:
            missing[n_missing] = i
            n_missing += 1
        else:
            o = out_rows[i]
            for c in range(rows.shape[1]):
                out[o, c] = rows[hit, c]
    return clock, n_missing


@njit(cache=True, nogil=True)
def _insert(set_block, way_keys, way_used, way_stamp, way_freq, way_row, way_dirty, rows, alloc,
            policy, keys, lines, clock, ev_keys, ev_lines):
    """Write lines (n, line_size) of keys (n,) in order; evicted dirty lines are copied to ev_*
    (clean ones have a copy below and are dropped). A set's first line takes the next free
    block, a way's first line the next free row (``alloc``: blocks and rows handed out, updated
    in place).

    Returns (clock, n_evicted_dirty, n_evicted, n_new).
    """
    n_sets = set_block.shape[0]
    ways = way_keys.shape[1]
    n_ev = 0
    n_gone = 0
    n_new = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        s = np.int64(jit_mix64(k) % np.uint64(n_sets))
        b = set_block[s]
        if b < 0:
            b = alloc[0]
            alloc[0] += 1
            set_block[s] = b
            for w in range(ways):  # the block may hold lines from before a clear()
                way_used[b, w] = False
                way_row[b, w] = -1
        target = -1
        free = -1
        for w in range(ways):
            if way_used[b, w]:
                if way_keys[b, w] == k:
                    target = w
                    break
            elif free < 0:
                free = w
        if target >= 0:
            way_freq[b, target] += 1
        else:
            n_new += 1
            if free >= 0:
                target = free
                if way_row[b, target] < 0:
                    way_row[b, target] = alloc[1]
                    alloc[1] += 1
            else:
                target = 0
                for w in range(1, ways):
                    if policy == 1:
                        fw = way_freq[b, w]
                        ft = way_freq[b, target]
                        if fw < ft or (fw == ft and way_stamp[b, w] < way_stamp[b, target]):
                            target = w
                    elif way_stamp[b, w] < way_stamp[b, target]:
                        target = w
                if way_dirty[b, target]:
                    ev_keys[n_ev] = way_keys[b, target]
                    ev_lines[n_ev, :] = rows[way_row[b, target], :]
                    n_ev += 1
                n_gone += 1
            way_keys[b, target] = k
            way_used[b, target] = True
            way_freq[b, target] = 1
        way_stamp[b, target] = clock
        way_dirty[b, target] = True
        clock += 1
        rows[way_row[b, target], :] = lines[i, :]
    return clock, n_ev, n_gone, n_new


@njit(cache=True, nogil=True)
def _release(set_block, way_keys, way_used, way_dirty, keys, free):
    """Mark the held lines of ``keys`` (n,) uint64 clean; ``free``: also free their ways (an
    erase: the rows stay with the ways for their next lines). Returns how many were held."""
    n_sets = set_block.shape[0]
    n = 0
    for i in range(keys.shape[0]):
        b = set_block[np.int64(jit_mix64(keys[i]) % np.uint64(n_sets))]
        if b < 0:
            continue
        for w in range(way_keys.shape[1]):
            if way_used[b, w] and way_keys[b, w] == keys[i]:
                way_dirty[b, w] = False
                if free:
                    way_used[b, w] = False
                n += 1
                break
    return n


def _keep_last(keys: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop all but the last eviction of each key, keeping the order of the last ones.

    A resident key can be evicted by an earlier key of the batch, come back in with its own
    (newer) line and be evicted again; only that newer line may go down, and the tier below
    expects unique keys.
    """
    m = keys.shape[0]
    if m < 2:
        return keys, lines
    first_in_reversed = np.unique(keys[::-1], return_index=True)[1]
    if first_in_reversed.shape[0] == m:
        return keys, lines
    last = np.sort(m - 1 - first_in_reversed)
    return keys[last], lines[last]


class SetAssociativeCache(Tier):
    """An evicting cache level of ``rows`` lines of ``line_size`` float32.

    ``rows`` is rounded down to whole sets; with fewer rows than ``ways`` the cache is one set of
    ``rows`` ways. Raises ``CapacityError`` when ``rows < 1``.
    """

    evicts = True

    def __init__(self, line_size: int, rows: int, ways: int = 32, policy: str = "lru",
                 name: str = "device.lru"):
        if policy not in POLICIES:
            raise ConfigError(f"cache policy {policy!r} is not one of {POLICIES}")
        if int(ways) < 1:
            raise ConfigError(f"ways={ways!r} must be >= 1")
        rows = int(rows)
        if rows < 1:
            raise CapacityError(
                f"{name}: a budget of {rows} rows cannot hold one line of {line_size} floats "
                f"({4 * line_size} bytes): raise cache_budget_mb"
            )
        self.line_size = int(line_size)
        self.name = name
        self.policy = policy
        self._policy_code = _LRU if policy == "lru" else _LFU
        self.ways = min(int(ways), rows)
        self.n_sets = rows // self.ways
        shape = (self.n_sets, self.ways)
        try:
            self._set_block = host_arrays.full(self.n_sets, -1, np.int64)
            # blocks and rows are handed out in order: only the used prefix is ever backed
            self._way_keys = host_arrays.zeros(shape, np.uint64)
            self._way_used = host_arrays.zeros(shape, np.bool_)
            self._way_stamp = host_arrays.zeros(shape, np.int64)
            self._way_freq = host_arrays.zeros(shape, np.int64)
            self._way_row = host_arrays.zeros(shape, np.int64)
            self._way_dirty = host_arrays.zeros(shape, np.bool_)
            self._rows = host_arrays.zeros((self.n_sets * self.ways, self.line_size), np.float32)
        except (MemoryError, OSError) as e:  # the address space for the budget was refused
            want_mb = self.n_sets * self.ways * (4 * self.line_size + 41) / 2**20
            raise CapacityError(
                f"{name}: cannot reserve {want_mb:,.0f} MB for {rows:,} lines of "
                f"{4 * self.line_size} bytes ({e}): lower cache_budget_mb to what this machine "
                "can hold"
            ) from None
        self._alloc = np.zeros(2, np.int64)  # blocks, rows handed out
        self._clock = 0
        self._size = 0

    @classmethod
    def from_options(cls, cache_options, line_size: int, name: str) -> "SetAssociativeCache":
        return cls(line_size, cache_options.rows(line_size), cache_options.ways,
                   cache_options.policy, name)

    @property
    def capacity(self) -> int:
        """Lines the cache can hold: n_sets * ways."""
        return self._rows.shape[0]

    def __len__(self) -> int:
        return self._size

    @property
    def memory_bytes(self) -> int:
        """Bytes reserved for the whole budget (only the part in use is backed by RAM)."""
        return sum(a.nbytes for a in self._arrays()) + self._set_block.nbytes

    @staticmethod
    def bytes_for(rows: int, ways: int, line_size: int) -> int:
        """``memory_bytes`` of a cache of ``rows`` lines (rounded down to whole sets) of
        ``line_size`` floats: per way its line, key, stamp, frequency and row (8 bytes each),
        used and dirty flags; per set its block number (the capacity planner's figure)."""
        ways = min(int(ways), int(rows))
        n_sets = int(rows) // ways
        return n_sets * ways * (4 * int(line_size) + 4 * 8 + 2) + n_sets * 8

    def _arrays(self) -> tuple:
        return (self._way_keys, self._way_used, self._way_stamp, self._way_freq, self._way_row,
                self._way_dirty, self._rows)

    def find(self, keys, out, out_rows):
        """keys: (n,) uint64; out: (N, line_size) float32; out_rows: (n,) int64 -> missing (m,)
        int64. Hits are copied into ``out[out_rows]`` and touched (recency, frequency)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        missing = np.empty(keys.shape[0], np.int64)
        self._clock, n_missing = _find(
            self._set_block, *self._arrays(), keys, self._clock, out,
            np.ascontiguousarray(out_rows, np.int64), missing)
        return missing[:n_missing]

    def insert_or_assign(self, keys, lines):
        """keys: (n,) uint64 unique, lines: (n, line_size) float32.

        Returns the evicted dirty lines (keys (m,) uint64 unique, lines (m, line_size)
        float32), m <= n, in the order of their last eviction; a key evicted twice in one call
        leaves with its newer line only. Evicted clean lines (identical below) are dropped.
        """
        keys = np.ascontiguousarray(keys, np.uint64)
        lines = np.ascontiguousarray(lines, np.float32)
        n = keys.shape[0]
        if n == 0:
            return empty_lines(self.line_size)
        ev_keys = np.empty(n, np.uint64)
        ev_lines = np.empty((n, self.line_size), np.float32)
        self._clock, n_ev, n_gone, n_new = _insert(
            self._set_block, *self._arrays(), self._alloc, self._policy_code, keys, lines,
            self._clock, ev_keys, ev_lines,
        )
        self._size += n_new - n_gone
        return _keep_last(ev_keys[:n_ev], ev_lines[:n_ev])

    def _held(self, dirty_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(keys (k,) uint64 sorted, rows (k,) int64): every held key (or every dirty one) and
        the row of its line."""
        blocks = int(self._alloc[0])
        used = self._way_used[:blocks]
        if dirty_only:
            used = used & self._way_dirty[:blocks]
        keys = self._way_keys[:blocks][used]
        order = np.argsort(keys, kind="stable")  # deterministic export order
        return keys[order], self._way_row[:blocks][used][order]

    def keys(self) -> np.ndarray:
        """Held keys (k,) uint64, sorted."""
        return self._held()[0]

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        keys, row_ids = self._held()
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[row_ids[start:stop]]

    def flush_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The dirty (keys (k,) uint64, lines (k, line_size) float32), sorted by key, in batches;
        each batch is marked clean once the caller asks for the next one (a caller that fails
        writing a batch down leaves it dirty)."""
        keys, row_ids = self._held(dirty_only=True)
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[row_ids[start:stop]]
            _release(self._set_block, self._way_keys, self._way_used, self._way_dirty,
                     keys[start:stop], False)

    def erase(self, keys) -> int:
        """Drop the lines of keys (n,) uint64, dirty or not (nothing goes down)."""
        n = _release(self._set_block, self._way_keys, self._way_used, self._way_dirty,
                     np.ascontiguousarray(keys, np.uint64), True)
        self._size -= n
        return int(n)

    def clear(self) -> None:
        # blocks and rows are handed out afresh (``_insert`` resets a block when it hands it out)
        self._set_block.fill(-1)
        self._alloc[:] = 0
        self._size = 0
