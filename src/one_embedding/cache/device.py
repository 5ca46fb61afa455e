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
from ..kernels import device_ops, device_unique
from ..tiers import StoreTier, Tier
from .set_associative import POLICIES

#: The slot word of an empty bucket (hashindex.cu's EMPTY; -1 as int64, as tiers.hash_index).
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
MAX_LOAD = 0.7
#: The slot of a key past the count of a fixed-capacity batch (hashindex.cu's NOT_LOOKED_UP).
NOT_LOOKED_UP = -2
#: One warp owns a set and lane w its way w.
MAX_WAYS = 32
#: Rows a DeviceFullStore reserves before its first growth (capacity permitting).
INITIAL_ROWS = 1 << 20
#: when a fixed-capacity insert (n keys, its new ones counted on the device) must read the
#: counts back to know the index and the rows still fit, it makes room for this many more
#: batches of n beyond the keys held, so that the next inserts' host bounds (the asynchronous
#: copy of the counts lags a step or two behind) fit without another read
HEADROOM_BATCHES = 2


def _host(a) -> np.ndarray:
    """A numpy copy of a device array (the array itself when it is numpy already)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _write_npy(path: str, array: np.ndarray) -> None:
    """``np.save`` then fsync (store.durable.write_array's format; cache may not import store)."""
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _capacity_for(n_keys: int) -> int:
    cap = 16
    while cap * MAX_LOAD < n_keys:
        cap *= 2
    return cap


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


# ---------------------------------------------------------------- the "full" index


class DeviceHashIndex:
    """uint64 key -> int64 slot on the device, ``tiers.HashIndex``'s twin.

    table: (capacity, 2) uint64 buckets ``[key, slot]``, open addressing with linear probing from
    ``mix64(key) & (capacity - 1)``, grown (rehashed) before the load passes 0.7. A new key gets
    the next slot in batch order (``find_or_insert``), exactly as on the CPU; there is no erase,
    so slots are dense. Inserts race for buckets (atomicCAS), so the bucket a key lands in may
    differ from run to run, but the (key, slot) pairs and every find do not.
    """

    def __init__(self, expected_keys: int = 0, launch=None):
        self._launch = device_ops.resolve(launch)
        self._xp = self._launch.xp
        self._allocate(_capacity_for(max(int(expected_keys), 1)))
        self._size = 0
        self._next_slot = 0
        # inserts without a read (``find_or_insert(distinct=True)``) count on the device:
        # (2,) int64 [size, next slot], read when the host needs them (``_settle``); until then
        # ``_bound`` is a host upper bound of the next slot (>= size), grown by each insert's
        # key count (a fixed-capacity batch's n, far above its new keys) and brought down
        # without a wait by an asynchronous copy of the counts (``_mirror``: event, page-locked
        # (2,) int64, ``_offered`` when it was queued)
        self._counts = None
        self._bound = 0
        self._offered = 0       # keys offered to device-counted inserts so far
        self._mirror = None

    def _settle(self) -> None:
        """Bring the device's counts back (one read, counted) when inserts ran since the last."""
        if self._counts is not None:
            size, next_slot = host_sync.to_host(self._counts, "device index: size").tolist()
            self._size, self._next_slot, self._counts = int(size), int(next_slot), None
        self._bound = self._next_slot
        self._mirror = None

    @property
    def slot_bound(self) -> int:
        """An upper bound of ``slot_limit`` known without a read: the next slot of the last
        counts copied back asynchronously (if that copy has landed), plus every key offered to
        an insert since it was queued."""
        mirror = self._mirror
        if mirror is not None and self._launch.done(mirror[0]):
            self._mirror = None
            _, counts, offered = mirror
            self._bound = min(self._bound, int(counts[1]) + (self._offered - offered))
        return max(self._bound, self._next_slot)

    def _copy_counts_back(self) -> None:
        """Queue the asynchronous copy of the device counts (one at a time; no wait)."""
        if self._mirror is None and self._counts is not None:
            counts = self._launch.host_empty((2,), np.int64)
            self._launch.to_host_async(self._counts, counts)
            self._mirror = (self._launch.record(), counts, self._offered)

    def _allocate(self, cap: int) -> None:
        self._table = self._xp.full((cap, 2), EMPTY, dtype=self._xp.uint64)

    def __len__(self) -> int:
        self._settle()
        return self._size

    @property
    def capacity(self) -> int:
        return self._table.shape[0]

    @property
    def slot_limit(self) -> int:
        """One past the highest slot handed out: the rows the storage behind must hold."""
        self._settle()
        return self._next_slot

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _reserve(self, extra: int, headroom: int = 0) -> None:
        """Room for ``extra`` more keys; when that takes a read of the counts, room for
        ``headroom`` more too, so that the next inserts' bounds fit without one."""
        if self.slot_bound + extra <= self.capacity * MAX_LOAD:  # size <= bound: no read
            return
        self._settle()
        need = self._size + extra + headroom
        if need <= self.capacity * MAX_LOAD:
            return
        keys, slots = self.items()
        self._allocate(_capacity_for(need))
        self._insert(keys, slots)

    def _insert(self, keys, slots) -> None:
        """Insert keys (m,) uint64 known to be absent, with their slots (m,) int64."""
        device_ops.launch_threads(self._launch, "hashindex", "insert", np.float32, keys.shape[0],
                                  (self._table, np.int64(self.capacity - 1), keys, slots,
                                   np.int64(keys.shape[0])))

    def _find(self, keys, rows=None, out=None, out_rows=None):
        """(slots (n,) int64, buckets (n,) int64), -1 where absent; copies found lines into
        ``out[out_rows]`` when ``rows`` is given."""
        xp = self._xp
        n = keys.shape[0]
        slots = xp.empty(n, dtype=xp.int64)
        buckets = xp.empty(n, dtype=xp.int64)
        if rows is None:
            # the row arguments are not read when line_size == 0; any float32 array stands in
            rows = out = xp.empty((1, 1), dtype=xp.float32)
            out_rows = slots
            line_size = 0
        else:
            line_size = rows.shape[1]
        device_ops.launch_warps(self._launch, "hashindex", "find", np.float32, n,
                                (self._table, np.int64(self.capacity - 1), keys, np.int64(n), rows,
                                 np.int32(line_size), out_rows, out, slots, buckets))
        return slots, buckets

    def _keys(self, keys):
        return device_ops.device_array(self._launch, "keys", keys, np.uint64, ndim=1)

    def find(self, keys):
        """keys: (n,) uint64 -> slots (n,) int64, -1 where absent."""
        return self._find(self._keys(keys))[0]

    def find_rows(self, keys, rows, out, out_rows):
        """``find`` that also copies ``rows[slot]`` into ``out[out_rows[i]]`` for every found key.
        rows: (R, L) float32; out: (N, L) float32 (written); out_rows: (n,) int64."""
        launch = self._launch
        keys = self._keys(keys)
        out = device_ops.device_array(launch, "out", out, np.float32, ndim=2, writable=True)
        out_rows = device_ops.device_array(launch, "out_rows", out_rows, np.int64, ndim=1)
        if out_rows.shape != keys.shape:
            raise InputError(f"out_rows {tuple(out_rows.shape)} must match keys {tuple(keys.shape)}")
        if out.shape[1] != rows.shape[1]:
            raise InputError(f"out has lines of {out.shape[1]} floats, the store {rows.shape[1]}")
        return self._find(keys, rows, out, out_rows)[0]

    def find_live(self, keys, live, rows=None, out=None):
        """``find`` of a fixed-capacity batch (``device_unique.unique_ids_fixed``): only the
        first ``live`` keys are looked up, without a read; with ``rows`` (R, L) float32, the line
        of found key i is copied into row i of ``out`` (n, L) float32 too. keys: (n,) uint64;
        live: (1,) int64 device count -> slots (n,) int64: the slot, -1 where absent,
        ``NOT_LOOKED_UP`` (-2) from ``live`` on."""
        xp = self._xp
        n = keys.shape[0]
        slots = xp.empty(n, dtype=xp.int64)
        if rows is None:   # not read when line_size == 0; any float32 array stands in
            rows = out = xp.empty((1, 1), dtype=xp.float32)
            line_size = 0
        else:
            line_size = rows.shape[1]
        device_ops.launch_warps(self._launch, "hashindex", "find_live", np.float32, n,
                                (self._table, np.int64(self.capacity - 1), keys, np.int64(n), live,
                                 rows, np.int32(line_size), out, slots))
        return slots

    def dedup_find_live(self, passes, rows=None, out=None):
        """The output pass of a fixed-capacity dedup (``device_unique.dedup_passes_fixed``'s
        ``passes``) with ``find_live`` of its unique keys fused in, one kernel ->
        (``device_unique.FixedUnique``, slots (n,) int64 as ``find_live``'s). rows / out: as
        ``find_live``'s. The index must not change while it runs (the chain's lock)."""
        return device_unique.unique_ids_fixed_find(passes, self._table, rows, out, self._launch)

    def find_or_insert(self, keys, distinct: bool = False):
        """keys: (n,) uint64 -> (slots (n,) int64, is_new (n,) bool); new keys take the next slots
        in batch order. A key given twice gets one slot, new at its first place only (as on the
        CPU): the insert kernel needs distinct keys, or both copies would claim a bucket.
        ``distinct=True``: the caller's keys are distinct, so the duplicate check (a host read) is
        skipped."""
        xp = self._xp
        keys = self._keys(keys)
        self._reserve(keys.shape[0])
        if distinct:
            return self._insert_new_on_device(keys)
        self._settle()
        slots, _ = self._find(keys)
        is_new = slots < 0
        m = device_ops.count_true(xp, is_new, "cache find_or_insert: new key count")
        if m:
            new = device_ops.positions_of(xp, is_new, m)
            new_keys = keys[new]
            if not distinct:
                order = xp.argsort(new_keys, kind="stable")     # equal keys: first place first
                ranked = new_keys[order]
                first = xp.ones(m, dtype=xp.bool_)
                first[1:] = ranked[1:] != ranked[:-1]
            if distinct or host_sync.flag(first.all(), "cache find_or_insert: duplicate keys"):
                new_slots = xp.arange(self._next_slot, self._next_slot + m, dtype=xp.int64)
                slots[new] = new_slots
            else:                                   # duplicates: one slot per distinct key
                n_place = device_ops.count_true(xp, first, "cache find_or_insert: distinct keys")
                place = order[device_ops.positions_of(xp, first, n_place)]  # first places
                slot_of = xp.empty(place.shape[0], dtype=xp.int64)
                slot_of[xp.argsort(place)] = xp.arange(      # slots in order of first place
                    self._next_slot, self._next_slot + place.shape[0], dtype=xp.int64)
                every = xp.empty(m, dtype=xp.int64)
                every[order] = slot_of[xp.cumsum(first) - 1]
                slots[new] = every
                is_new[new] = False
                is_new[new[place]] = True
                new_keys, new_slots, m = ranked[first], slot_of, int(place.shape[0])
            self._insert(new_keys, new_slots)
            self._next_slot += m
            self._size += m
        return slots, is_new

    def insert_live(self, keys, live):
        """``find_or_insert(keys, distinct=True)`` of a fixed-capacity batch: only the first
        ``live`` ((1,) int64 device count) of the n distinct keys; the others get slot
        ``NOT_LOOKED_UP`` and are neither new nor inserted. No read: the host's slot bound grows
        by n, an upper bound of the keys inserted."""
        keys = self._keys(keys)
        self._reserve(keys.shape[0], headroom=HEADROOM_BATCHES * keys.shape[0])
        return self._insert_new_on_device(keys, live)

    def _insert_new_on_device(self, keys, live=None):
        """``find_or_insert`` of distinct keys without a read: a new key's slot is the device's
        next slot plus its rank among the new keys (batch order, as on the CPU), the masked
        insert kernel adds them, and the counts stay on the device. live: the keys' count in a
        fixed-capacity batch (None: all of them)."""
        xp = self._xp
        n = keys.shape[0]
        if live is None:
            slots, _ = self._find(keys)
            is_new = slots < 0
        else:                       # NOT_LOOKED_UP (-2) past the count: not new
            slots = self.find_live(keys, live)
            is_new = slots == -1
        if n == 0:
            return slots, is_new
        rank = xp.cumsum(is_new, dtype=xp.int64)                 # (n,) inclusive
        counts = self._counts if self._counts is not None else \
            xp.asarray(np.array([self._size, self._next_slot], np.int64))
        slots = xp.where(is_new, counts[1] + rank - 1, slots)
        device_ops.launch_threads(self._launch, "hashindex", "insert_where", np.float32, n,
                                  (self._table, np.int64(self.capacity - 1), keys, slots,
                                   is_new.view(xp.uint8), np.int64(n)))
        self._counts = counts + rank[-1]
        self._bound = self.slot_bound + n
        self._offered += n
        self._copy_counts_back()
        return slots, is_new

    def assign(self, keys, slots) -> None:
        """Insert or overwrite key -> slot (restoring an index as it was saved); keys unique."""
        self._settle()
        xp = self._xp
        keys = self._keys(keys)
        slots = device_ops.device_array(self._launch, "slots", slots, np.int64, ndim=1)
        self._reserve(keys.shape[0])
        _, buckets = self._find(keys)
        held = buckets >= 0
        self._table[buckets[held], 1] = slots[held].view(xp.uint64)
        new = device_ops.flatnonzero(xp, ~held, "device index assign: new keys")
        if new.shape[0]:
            self._insert(keys[new], slots[new])
            self._size += int(new.shape[0])
        if slots.shape[0]:
            self._next_slot = max(self._next_slot, int(slots.max()) + 1)

    def items(self):
        """All (keys (n,) uint64, slots (n,) int64), in bucket order."""
        xp = self._xp
        used = device_ops.flatnonzero(xp, self._table[:, 1] != EMPTY, "device index: items")
        return self._table[used, 0], self._table[used, 1].view(xp.int64)

    def clear(self) -> None:
        self._table.fill(EMPTY)
        self._size = 0
        self._next_slot = 0
        self._counts, self._bound, self._mirror = None, 0, None


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
            device_ops.launch_threads(self._launch, "hashindex", "put_rows", np.float32,
                                      n * self.line_size,
                                      (self._rows, np.int32(self.line_size), slots,
                                       xp.ascontiguousarray(lines), np.int64(n), live))
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
    """A batch's positions grouped by cache set, for cache.cu.

    keys: (n,) uint64 -> (order (n,) int64 positions sorted by (set, position), starts (g + 1,)
    int64 group boundaries, set_ids (g,) int64 the set of each group), set = mix64(key) % n_sets.
    (set, position) is packed into one distinct uint64, so any sort gives the same grouping.
    """
    n = keys.shape[0]
    if n and n_sets * n >= 1 << 64:
        raise InputError(f"a batch of {n} keys over {n_sets} sets cannot be grouped in 64 bits: "
                         "split the batch")
    n64 = xp.uint64(max(n, 1))
    sets = mix64(xp, keys) % xp.uint64(n_sets)
    packed = xp.sort(sets * n64 + xp.arange(n, dtype=xp.uint64))
    order = (packed % n64).astype(xp.int64)
    sorted_sets = packed // n64
    head = xp.ones(n, dtype=xp.bool_)
    head[1:] = sorted_sets[1:] != sorted_sets[:-1]
    first = device_ops.flatnonzero(xp, head, "device cache: sets in a batch")
    starts = xp.empty(first.shape[0] + 1, dtype=xp.int64)
    starts[:-1] = first
    starts[-1] = n
    return order, starts, sorted_sets[first].astype(xp.int64)


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
        self._rows = xp.zeros((self.n_sets * self.ways, self.line_size), dtype=xp.float32)
        self._clock = 0
        self._size = 0

    @classmethod
    def from_options(cls, cache_options, line_size: int, name: str, launch=None) -> "DeviceCache":
        return cls(line_size, cache_options.rows(line_size), cache_options.ways, cache_options.policy,
                   name, launch)

    @property
    def capacity(self) -> int:
        """Lines the cache can hold: n_sets * ways."""
        return self._rows.shape[0]

    def __len__(self) -> int:
        return self._size

    @property
    def memory_bytes(self) -> int:
        return int(self._rows.nbytes + self._way_keys.nbytes + self._way_stamp.nbytes
                   + self._way_freq.nbytes)

    def _state(self) -> tuple:
        return self._way_keys, self._way_stamp, self._way_freq, self._rows, np.int32(self.ways), \
            np.int32(self.line_size)

    def find(self, keys, out, out_rows):
        """keys: (n,) uint64; out: (N, line_size) float32; out_rows: (n,) int64 -> missing (m,)
        int64 ascending. Hits are copied into ``out[out_rows]`` and touched (recency, frequency)."""
        launch, xp = self._launch, self._xp
        keys = device_ops.device_array(launch, "keys", keys, np.uint64, ndim=1)
        out = device_ops.device_array(launch, "out", out, np.float32, ndim=2, writable=True)
        out_rows = device_ops.device_array(launch, "out_rows", out_rows, np.int64, ndim=1)
        n = keys.shape[0]
        if out_rows.shape[0] != n or out.shape[1] != self.line_size:
            raise InputError(f"out {tuple(out.shape)} / out_rows {tuple(out_rows.shape)} do not fit "
                             f"{n} keys and lines of {self.line_size} floats")
        if n == 0:
            return xp.empty(0, dtype=xp.int64)
        order, starts, set_ids = group_by_set(xp, keys, self.n_sets)
        hit = xp.empty(n, dtype=xp.int32)
        way_keys, way_stamp, way_freq, rows, ways, line_size = self._state()
        device_ops.launch_warps(launch, "cache", "find", np.float32, set_ids.shape[0],
                                (way_keys, way_stamp, way_freq, rows, ways, line_size, keys, order,
                                 starts, set_ids, np.int64(set_ids.shape[0]), np.int64(self._clock),
                                 out_rows, out, hit))
        self._clock += n
        return device_ops.flatnonzero(xp, hit == 0, "miss keys to host tier")

    def insert_or_assign(self, keys, lines):
        """keys: (n,) uint64 unique, lines: (n, line_size) float32.

        Returns the evicted (keys (m,) uint64 unique, lines (m, line_size) float32), m <= n, in
        the order of their last eviction; a key evicted twice in one call leaves once, with its
        newer line.
        """
        launch, xp = self._launch, self._xp
        keys = device_ops.device_array(launch, "keys", keys, np.uint64, ndim=1)
        lines = device_ops.device_array(launch, "lines", lines, np.float32, ndim=2)
        n = keys.shape[0]
        if lines.shape != (n, self.line_size):
            raise InputError(f"lines {tuple(lines.shape)} must be ({n}, {self.line_size})")
        if n == 0:
            return xp.empty(0, dtype=xp.uint64), xp.empty((0, self.line_size), dtype=xp.float32)
        order, starts, set_ids = group_by_set(xp, keys, self.n_sets)
        ev_keys = xp.empty(n, dtype=xp.uint64)
        ev_lines = xp.empty((n, self.line_size), dtype=xp.float32)
        ev_flag = xp.zeros(n, dtype=xp.int32)      # 1 evicted here, 2 evicted again later
        new_flag = xp.empty(n, dtype=xp.int32)
        way_keys, way_stamp, way_freq, rows, ways, line_size = self._state()
        device_ops.launch_warps(launch, "cache", "insert", np.float32, set_ids.shape[0],
                                (way_keys, way_stamp, way_freq, rows, ways, line_size,
                                 np.int32(self._policy_code), keys, lines, order, starts, set_ids,
                                 np.int64(set_ids.shape[0]), np.int64(self._clock), ev_keys, ev_lines,
                                 ev_flag, new_flag))
        self._clock += n
        leaving = device_ops.flatnonzero(xp, ev_flag == 1, "cache evictions to host tier")
        self._size += (host_sync.scalar(new_flag.sum(), "cache size: new lines")
                       - device_ops.count_true(xp, ev_flag, "cache size: evicted lines"))
        return ev_keys[leaving], ev_lines[leaving]

    def _held(self):
        """(keys (k,) uint64 sorted, rows (k,) int64): every held key and the row of its line."""
        xp = self._xp
        used = device_ops.flatnonzero(xp, self._way_stamp.reshape(-1) >= 0,
                                      "device cache: held lines")
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
        self._size = 0
