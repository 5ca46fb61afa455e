"""Tiers in device memory, on CuPy arrays: the "full" store (hash index + rows) and the
set-associative LRU / LFU cache, both driven by the CUDA kernels of ``kernels/cuda/hashindex.cu``
and ``kernels/cuda/cache.cu``.

They implement the tier verbs of ``tiers.tier`` with keys, rows and results on the device:
``find(keys, out, out_rows) -> missing`` takes cupy ``keys`` (n,) uint64, ``out`` (N, line_size)
float32 and ``out_rows`` (n,) int64 and returns cupy ``missing`` (m,) int64; ``insert_or_assign``
returns the evicted (keys, lines) as cupy arrays. Nothing here copies rows to the host except the
snapshot methods: the chain is the only place rows cross between device and host.

Every result equals the CPU twin's for the same call sequence: ``DeviceHashIndex`` /
``DeviceFullStore`` those of ``tiers.HashIndex`` / ``store.MemoryStore`` (the same slots in the
same order), ``DeviceCache`` those of ``cache.SetAssociativeCache`` (the same hits, victims and
evicted lines, in the same order). The classes take a ``launch`` (``kernels.device_ops.Launcher``):
by default the CuPy launcher of the current device; the tests pass one that runs the same kernels
on numpy arrays through the host emulator, which is how this module is verified without a GPU.
``import cupy`` happens only through the launcher.
"""
from __future__ import annotations

import os
import warnings
from typing import Iterator

import numpy as np

from .. import host_sync
from ..errors import CapacityError, ConfigError, InputError, SnapshotError
from ..hashing import mix64
from ..kernels import device_ops
from ..tiers import StoreTier, Tier
# the index and its constants, importable from here as before the split
from .device_index import EMPTY, HEADROOM_BATCHES, MAX_LOAD, NOT_LOOKED_UP  # noqa: F401
from .device_index import DeviceHashIndex
from .set_associative import POLICIES

#: One warp owns a set and lane w its way w.
MAX_WAYS = 32
#: Rows a DeviceFullStore reserves before its first growth (capacity permitting).
INITIAL_ROWS = 1 << 20


def _host(a) -> np.ndarray:
    """A numpy copy of a device array (the array itself when it is numpy already)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _write_npy(path: str, array: np.ndarray) -> None:
    """``np.save`` then fsync (store.durable.write_array's format; cache may not import store)."""
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


class _OnDevice:
    """What the tier chain reads of a device tier: it lives in device memory (``on_device``),
    its arrays belong to ``xp`` and its kernels run through ``launch``."""

    #: rows live in device memory: the chain copies keys and lines across when they go to or
    #: come from a host tier
    on_device = True
    _launch: device_ops.Launcher

    @property
    def launch(self) -> device_ops.Launcher:
        return self._launch

    @property
    def xp(self):
        return self._launch.xp


# ---------------------------------------------------------------- the "full" store


class DeviceFullStore(_OnDevice, StoreTier):
    """Every key's line in device memory, found through a ``DeviceHashIndex``: the device_mem
    preset's tier on a GPU, ``store.MemoryStore``'s twin (same snapshot files).

    ``capacity`` is a sizing hint: past it the rows array doubles (with a warning), as on CPU.
    """

    def __init__(self, line_size: int, capacity: int | None = None, name: str = "device.full",
                 launch=None):
        self.line_size = int(line_size)
        self.name = name
        self.capacity = int(capacity) if capacity else None
        self._launch = device_ops.resolve(launch)
        self._xp = self._launch.xp
        # device memory is not backed lazily: reserve up to INITIAL_ROWS, then grow by doubling
        initial = min(self.capacity or 1024, INITIAL_ROWS)
        self._index = DeviceHashIndex(initial, self._launch)
        self._rows = self._xp.zeros((initial, self.line_size), dtype=self._xp.float32)
        self._warned = False

    def __len__(self) -> int:
        return len(self._index)

    @property
    def memory_bytes(self) -> int:
        return int(self._rows.nbytes) + self._index.nbytes

    def _ensure_rows(self, n_rows: int, headroom: int = 0) -> None:
        """Rows for slots below ``n_rows`` (and ``headroom`` more: room that the next inserts'
        host bounds need, so they fit without a read; past ``capacity`` too, without a
        warning: the warning is for keys)."""
        want = n_rows + headroom
        if want <= self._rows.shape[0]:
            return
        if self.capacity and n_rows > self.capacity and not self._warned:
            warnings.warn(f"{self.name}: {n_rows} keys exceed capacity={self.capacity}; growing the "
                          "table (set capacity to the expected number of keys to avoid regrowth)",
                          RuntimeWarning, stacklevel=4)
            self._warned = True
        rows = max(want, 2 * self._rows.shape[0])
        if self.capacity and n_rows <= self.capacity:
            rows = min(rows, max(want, self.capacity))
        grown = self._xp.zeros((rows, self.line_size), dtype=self._xp.float32)
        grown[: self._rows.shape[0]] = self._rows
        self._rows = grown

    def find(self, keys, out, out_rows):
        """keys: (n,) uint64; out: (N, line_size) float32; out_rows: (n,) int64 -> missing (m,)
        int64 ascending, all on the device."""
        slots = self._index.find_rows(keys, self._rows, out, out_rows)
        return device_ops.flatnonzero(self._xp, slots < 0, "device store find: missing count")

    def find_found(self, keys, out, live=None):
        """keys: (n,) uint64; out: (n, line_size) float32, row i written with key i's line where
        held -> found (n,) bool, on the device: no count is read back. live: (1,) int64 device
        count of a fixed-capacity batch (``device_unique.unique_ids_fixed``): only its first
        ``live`` keys are looked up, the others come back found (nothing to initialise or
        count there) with their rows of ``out`` untouched."""
        if live is not None:
            return self._index.find_live(keys, live, self._rows, out) != -1
        rows = self._xp.arange(keys.shape[0], dtype=self._xp.int64)
        return self._index.find_rows(keys, self._rows, out, rows) >= 0

    def dedup_find_found(self, passes, out):
        """``find_found`` of a fixed-capacity batch fused into its dedup's output pass:
        passes: ``device_unique.dedup_passes_fixed``'s (n ids); out: (n, line_size) float32 ->
        (``device_unique.FixedUnique`` of the batch, found (n,) bool as ``find_found(fixed.keys,
        out, fixed.count)`` gives), no read."""
        fixed, slots = self._index.dedup_find_live(passes, self._rows, out)
        return fixed, slots != -1

    def insert_or_assign(self, keys, lines, live=None):
        """keys: (n,) uint64 unique, lines: (n, line_size) float32 -> nothing evicted (empty).
        live: (1,) int64 device count of a fixed-capacity batch: only its first ``live`` keys
        and lines are stored (no read)."""
        xp = self._xp
        lines = device_ops.device_array(self._launch, "lines", lines, np.float32, ndim=2)
        if live is None:
            slots, _ = self._index.find_or_insert(keys, distinct=True)  # unique, as documented
        else:
            slots, _ = self._index.insert_live(keys, live)
        if lines.shape != (slots.shape[0], self.line_size):
            raise InputError(f"lines {tuple(lines.shape)} must be ({slots.shape[0]}, {self.line_size})")
        if self._index.slot_bound > self._rows.shape[0]:  # else the rows hold every slot: no read
            # one read; a fixed-capacity batch leaves room for the next ones' bounds
            self._ensure_rows(self._index.slot_limit,
                              0 if live is None else HEADROOM_BATCHES * slots.shape[0])
        if live is None:
            self._rows[slots] = lines
        else:
            n = slots.shape[0]
            lines = xp.ascontiguousarray(lines)
            vector = device_ops.line_vector(np.float32, self.line_size, (self._rows, lines))
            per_line = self.line_size // 4 if vector else self.line_size   # float4s or floats
            device_ops.launch_threads(self._launch, "hashindex", "put_rows", np.float32,
                                      n * per_line,
                                      (self._rows, np.int32(self.line_size), vector, slots,
                                       lines, np.int64(n), live))
        return xp.empty(0, dtype=xp.uint64), xp.empty((0, self.line_size), dtype=xp.float32)

    def _sorted_items(self):
        keys, slots = self._index.items()
        order = self._xp.argsort(keys)  # keys are distinct: one order, the CPU store's
        return keys[order], slots[order]

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple]:
        keys, slots = self._sorted_items()
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[slots[start:stop]]

    def clear(self) -> None:
        self._index.clear()

    def erase(self, keys) -> int:
        """Drop keys (n,) uint64. The device index has no erase: the store is rebuilt from the
        rows it keeps (O(rows), as often as a lifecycle sweep, which reads them all anyway)."""
        xp = self._xp
        keys = device_ops.device_array(self._launch, "keys", keys, np.uint64, ndim=1)
        held_keys, slots = self._sorted_items()
        gone = xp.isin(held_keys, keys)
        n = device_ops.count_true(xp, gone, "device store erase: erased count")
        if n:
            keep = device_ops.positions_of(xp, ~gone, held_keys.shape[0] - n)
            rows = self._rows[slots[keep]]
            self._index.clear()
            self._index.assign(held_keys[keep], xp.arange(keep.shape[0], dtype=xp.int64))
            self._rows[: keep.shape[0]] = rows
        return n

    def save_snapshot(self, directory: str) -> None:
        """keys.npy + lines.npy sorted by key, fsync'd: MemoryStore's files, so either loads them."""
        keys, slots = self._sorted_items()
        _write_npy(os.path.join(directory, "keys.npy"), _host(keys))
        _write_npy(os.path.join(directory, "lines.npy"), _host(self._rows[slots]))

    def load_snapshot(self, directory: str) -> None:
        keys = np.load(os.path.join(directory, "keys.npy"), allow_pickle=False)
        lines = np.load(os.path.join(directory, "lines.npy"), allow_pickle=False)
        if lines.shape != (keys.shape[0], self.line_size):
            raise SnapshotError(f"snapshot {directory!r} holds lines of shape {lines.shape}, "
                                f"expected ({keys.shape[0]}, {self.line_size})")
        self.clear()
        self.insert_or_assign(self._xp.asarray(keys), self._xp.asarray(lines))


# ---------------------------------------------------------------- the set-associative cache


def group_by_set(xp, keys, n_sets: int):
    """A batch's positions grouped by cache set, for cache.cu, without reading the number of
    groups back: the arrays have room for n groups (a set per key), the g real ones first.

    keys: (n,) uint64 -> (order (n,) int64 positions sorted by (set, position), starts (n + 1,)
    int64 group boundaries: group k is order[starts[k]:starts[k + 1]], the g real groups first,
    then empty ones (starts n), set_ids (n,) int64 the set of each real group (0 past them)),
    set = mix64(key) % n_sets. (set, position) is packed into one distinct uint64, so any sort
    gives the same grouping. The kernels skip the empty groups.
    """
    n = keys.shape[0]
    if n and n_sets * n >= 1 << 64:
        raise InputError(f"a batch of {n} keys over {n_sets} sets cannot be grouped in 64 bits: "
                         "split the batch")
    n64 = xp.uint64(max(n, 1))
    sets = mix64(xp, keys) % xp.uint64(n_sets)
    packed = xp.sort(sets * n64 + xp.arange(n, dtype=xp.uint64))
    order = (packed % n64).astype(xp.int64)
    sorted_sets = (packed // n64).astype(xp.int64)
    head = xp.ones(n, dtype=xp.bool_)
    head[1:] = sorted_sets[1:] != sorted_sets[:-1]
    group = xp.cumsum(head, dtype=xp.int64) - 1                  # (n,) each position's group
    # each group's first position lands at its group's index; the other positions on spare
    # slot n + 1, which no group reads; slots g .. n keep n (the empty groups)
    starts = xp.full(n + 2, n, dtype=xp.int64)
    starts[xp.where(head, group, n + 1)] = xp.arange(n, dtype=xp.int64)
    set_ids = xp.zeros(n + 1, dtype=xp.int64)
    set_ids[xp.where(head, group, n)] = sorted_sets
    return order, starts[:n + 1], set_ids[:n]


class DeviceCache(_OnDevice, Tier):
    """An evicting cache level in device memory: ``n_sets`` sets of ``ways`` <= 32 ways holding
    lines of ``line_size`` float32, with "lru" or "lfu" replacement.

    ``SetAssociativeCache``'s twin: ``rows`` is rounded down to whole sets (fewer rows than ways
    make one set of ``rows`` ways), a key lives in set ``mix64(key) % n_sets``, and every call
    hits, evicts and returns exactly what the CPU cache does for the same calls. A launch groups
    the batch's keys by set and one warp handles each set's keys in batch order
    (``kernels/cuda/cache.cu``). The whole budget is allocated up front, as GPU caches do.
    """

    evicts = True

    def __init__(self, line_size: int, rows: int, ways: int = 32, policy: str = "lru",
                 name: str = "device.lru", launch=None):
        if policy not in POLICIES:
            raise ConfigError(f"cache policy {policy!r} is not one of {POLICIES}")
        if not 1 <= int(ways) <= MAX_WAYS:
            raise ConfigError(f"ways={ways!r}: the device cache holds 1 to {MAX_WAYS} ways per set "
                              "(one warp per set)")
        rows = int(rows)
        if rows < 1:
            raise CapacityError(f"{name}: a budget of {rows} rows cannot hold one line of {line_size} "
                                f"floats ({4 * line_size} bytes): raise cache_budget_mb")
        self.line_size = int(line_size)
        self.name = name
        self.policy = policy
        self._policy_code = POLICIES.index(policy)   # 0 lru, 1 lfu, as set_associative / cache.cu
        self.ways = min(int(ways), rows)
        self.n_sets = rows // self.ways
        self._launch = device_ops.resolve(launch)
        xp = self._xp = self._launch.xp
        shape = (self.n_sets, self.ways)
        self._way_keys = xp.zeros(shape, dtype=xp.uint64)
        self._way_stamp = xp.full(shape, -1, dtype=xp.int64)    # -1: the way is empty
        self._way_freq = xp.zeros(shape, dtype=xp.int64)
        self._way_dirty = xp.zeros(shape, dtype=xp.uint8)      # 1: newer than the copy below
        self._rows = xp.zeros((self.n_sets * self.ways, self.line_size), dtype=xp.float32)
        self._clock = 0
        # lines held, counted on the device by each insert (a host count would read two numbers
        # back per insert); read by len()
        self._size = xp.zeros((), dtype=xp.int64)

    @classmethod
    def from_options(cls, cache_options, line_size: int, name: str, launch=None) -> "DeviceCache":
        return cls(line_size, cache_options.rows(line_size), cache_options.ways, cache_options.policy,
                   name, launch)

    @property
    def capacity(self) -> int:
        """Lines the cache can hold: n_sets * ways."""
        return self._rows.shape[0]

    def __len__(self) -> int:
        return int(host_sync.scalar(self._size, "device cache: size"))

    @property
    def memory_bytes(self) -> int:
        return int(self._rows.nbytes + self._way_keys.nbytes + self._way_stamp.nbytes
                   + self._way_freq.nbytes + self._way_dirty.nbytes)

    @staticmethod
    def bytes_for(rows: int, ways: int, line_size: int) -> int:
        """``memory_bytes`` of a device cache of ``rows`` lines (rounded down to whole sets) of
        ``line_size`` floats: per way its line, key, stamp and frequency (8 bytes each) and dirty
        flag (the capacity planner's figure under ``--device cuda``)."""
        ways = min(int(ways), int(rows))
        return (int(rows) // ways) * ways * (4 * int(line_size) + 3 * 8 + 1)

    def _state(self) -> tuple:
        return self._way_keys, self._way_stamp, self._way_freq, self._rows, np.int32(self.ways), \
            np.int32(self.line_size)

    def find(self, keys, out, out_rows):
        """keys: (n,) uint64; out: (N, line_size) float32; out_rows: (n,) int64 -> missing (m,)
        int64 ascending. Hits are copied into ``out[out_rows]`` and touched (recency, frequency)."""
        missing = self.find_missing(keys, out, out_rows)
        if missing.shape[0] == 0:
            return self._xp.empty(0, dtype=self._xp.int64)
        return device_ops.flatnonzero(self._xp, missing, "miss keys to host tier")

    def find_missing(self, keys, out, out_rows):
        """``find`` without its read: -> (n,) bool device mask of the keys not held."""
        launch, xp = self._launch, self._xp
        keys = device_ops.device_array(launch, "keys", keys, np.uint64, ndim=1)
        out = device_ops.device_array(launch, "out", out, np.float32, ndim=2, writable=True)
        out_rows = device_ops.device_array(launch, "out_rows", out_rows, np.int64, ndim=1)
        n = keys.shape[0]
        if out_rows.shape[0] != n or out.shape[1] != self.line_size:
            raise InputError(f"out {tuple(out.shape)} / out_rows {tuple(out_rows.shape)} do not fit "
                             f"{n} keys and lines of {self.line_size} floats")
        if n == 0:
            return xp.zeros(0, dtype=xp.bool_)
        order, starts, set_ids = group_by_set(xp, keys, self.n_sets)
        hit = xp.empty(n, dtype=xp.int32)
        way_keys, way_stamp, way_freq, rows, ways, line_size = self._state()
        vector = device_ops.line_vector(np.float32, self.line_size, (rows, out))
        device_ops.launch_warps(launch, "cache", "find", np.float32, set_ids.shape[0],
                                (way_keys, way_stamp, way_freq, rows, ways, line_size, vector, keys,
                                 order, starts, set_ids, np.int64(set_ids.shape[0]),
                                 np.int64(self._clock), out_rows, out, hit))
        self._clock += n
        return hit == 0

    def insert_or_assign(self, keys, lines):
        """keys: (n,) uint64 unique, lines: (n, line_size) float32.

        Returns the evicted dirty lines (keys (m,) uint64 unique, lines (m, line_size)
        float32), m <= n, in the order of their last eviction; a key evicted twice in one call
        leaves once, with its newer line. Evicted clean lines (flushed since their last write:
        the level below holds the same) are dropped. Every written line is dirty.
        """
        ev_keys, ev_lines, leaving = self.insert_pending(keys, lines)
        if leaving.shape[0] == 0:
            return ev_keys, ev_lines
        taken = device_ops.flatnonzero(self._xp, leaving, "cache evictions to host tier")
        return ev_keys[taken], ev_lines[taken]

    def insert_pending(self, keys, lines):
        """``insert_or_assign`` without its read: -> (ev_keys (n,) uint64, ev_lines (n,
        line_size) float32, leaving (n,) bool), device arrays: the evicted dirty lines are
        ``ev_keys[leaving]`` with ``ev_lines[leaving]``, in that order (the chain takes them
        when it next needs the device's counts anyway)."""
        launch, xp = self._launch, self._xp
        keys = device_ops.device_array(launch, "keys", keys, np.uint64, ndim=1)
        lines = device_ops.device_array(launch, "lines", lines, np.float32, ndim=2)
        n = keys.shape[0]
        if lines.shape != (n, self.line_size):
            raise InputError(f"lines {tuple(lines.shape)} must be ({n}, {self.line_size})")
        if n == 0:
            return (xp.empty(0, dtype=xp.uint64), xp.empty((0, self.line_size), dtype=xp.float32),
                    xp.zeros(0, dtype=xp.bool_))
        order, starts, set_ids = group_by_set(xp, keys, self.n_sets)
        ev_keys = xp.empty(n, dtype=xp.uint64)
        ev_lines = xp.empty((n, self.line_size), dtype=xp.float32)
        ev_flag = xp.zeros(n, dtype=xp.int32)   # 1 evicted here, 2 again later, 3 clean: dropped
        new_flag = xp.empty(n, dtype=xp.int32)
        way_keys, way_stamp, way_freq, rows, ways, line_size = self._state()
        vector = device_ops.line_vector(np.float32, self.line_size, (rows, lines, ev_lines))
        device_ops.launch_warps(launch, "cache", "insert", np.float32, set_ids.shape[0],
                                (way_keys, way_stamp, way_freq, self._way_dirty, rows, ways,
                                 line_size, vector, np.int32(self._policy_code), keys, lines,
                                 order, starts, set_ids, np.int64(set_ids.shape[0]),
                                 np.int64(self._clock), ev_keys, ev_lines, ev_flag, new_flag))
        self._clock += n
        self._size += new_flag.sum() - xp.count_nonzero(ev_flag)
        return ev_keys, ev_lines, ev_flag == 1

    def _held(self, dirty_only: bool = False):
        """(keys (k,) uint64 sorted, rows (k,) int64): every held key (or every dirty one) and
        the row of its line."""
        xp = self._xp
        held = self._way_stamp.reshape(-1) >= 0
        if dirty_only:
            held &= self._way_dirty.reshape(-1) != 0
        used = device_ops.flatnonzero(xp, held, "device cache: held lines")
        keys = self._way_keys.reshape(-1)[used]
        order = xp.argsort(keys)  # held keys are distinct: one order
        return keys[order], used[order]

    def keys(self):
        """Held keys (k,) uint64, sorted."""
        return self._held()[0]

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple]:
        keys, row_ids = self._held()
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[row_ids[start:stop]]

    def flush_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple]:
        """The dirty (keys (k,) uint64, lines (k, line_size) float32), sorted by key, in batches
        (``SetAssociativeCache.flush_batches``' twin); each batch is marked clean once the caller
        asks for the next one (a caller that fails writing a batch down leaves it dirty), so an
        evicted clean line and the next flush write nothing of it."""
        keys, row_ids = self._held(dirty_only=True)
        dirty = self._way_dirty.reshape(-1)
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self._rows[row_ids[start:stop]]
            dirty[row_ids[start:stop]] = 0

    def erase(self, keys) -> int:
        """Drop the lines of keys (n,) uint64 (their ways become empty)."""
        xp = self._xp
        keys = device_ops.device_array(self._launch, "keys", keys, np.uint64, ndim=1)
        if keys.shape[0] == 0:
            return 0
        sets = (mix64(xp, keys) % xp.uint64(self.n_sets)).astype(xp.int64)
        match = (self._way_keys[sets] == keys[:, None]) & (self._way_stamp[sets] >= 0)
        hits = device_ops.flatnonzero(xp, match.reshape(-1), "device cache erase: erased lines")
        rows, ways = hits // match.shape[1], hits % match.shape[1]
        self._way_stamp[sets[rows], ways] = -1
        n = int(rows.shape[0])
        self._size -= n
        return n

    def clear(self) -> None:
        self._way_stamp.fill(-1)
        self._way_dirty.fill(0)
        self._size.fill(0)
