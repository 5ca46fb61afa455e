"""The device hash index: uint64 key -> int64 slot in device memory, ``tiers.HashIndex``'s
twin (the same slots in the same order), driven by ``kernels/cuda/hashindex.cu``. The index of
``cache.device.DeviceFullStore`` (the device_mem preset's store on a GPU).

Inserts of distinct keys keep their counts on the device; the host holds an upper bound of the
next slot, brought back to the true count without a wait by an asynchronous copy of the counts,
and reads the counts (one counted read) only when the bound could pass the table's load limit.
Takes a ``launch`` (``kernels.device_ops.Launcher``), as ``cache.device``'s tiers do.
"""
from __future__ import annotations

import numpy as np

from .. import host_sync
from ..errors import InputError
from ..kernels import device_ops, device_unique, hash_find
# the CPU twin's load limit and sizing, so both grow at the same sizes
from ..tiers.hash_index import MAX_LOAD, _capacity_for  # noqa: F401 - MAX_LOAD re-exported

#: The slot word of an empty bucket (hashindex.cu's EMPTY; -1 as int64, as tiers.hash_index).
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
#: The slot of a key past the count of a fixed-capacity batch (hashindex.cu's NOT_LOOKED_UP).
NOT_LOOKED_UP = -2
#: when a fixed-capacity insert (n keys, its new ones counted on the device) must read the
#: counts back to know the index and the rows still fit, it makes room for this many more
#: batches of n beyond the keys held, so that the next inserts' host bounds (the asynchronous
#: copy of the counts lags a step or two behind) fit without another read
HEADROOM_BATCHES = 2


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
        # (2,) int64, ``_offered`` when it was queued, the ``_epoch`` it belongs to). A read
        # or a clear starts a new epoch: a copy of an older one still lands in its buffer (kept
        # referenced until then, so the pinned pool cannot hand the buffer out meanwhile) but
        # is not used
        self._counts = None
        self._bound = 0
        self._offered = 0       # keys offered to device-counted inserts so far
        self._mirror = None
        self._epoch = 0

    def _settle(self) -> None:
        """Bring the device's counts back (one read, counted) when inserts ran since the last."""
        if self._counts is not None:
            size, next_slot = host_sync.to_host(self._counts, "device index: size").tolist()
            self._size, self._next_slot, self._counts = int(size), int(next_slot), None
        self._bound = self._next_slot
        self._epoch += 1

    @property
    def slot_bound(self) -> int:
        """An upper bound of ``slot_limit`` known without a read: the next slot of the last
        counts copied back asynchronously (if that copy has landed), plus every key offered to
        an insert since it was queued."""
        self._take_landed_copy()
        return max(self._bound, self._next_slot)

    def _take_landed_copy(self) -> None:
        """Lower the bound to the counts of the asynchronous copy, once it has landed (a copy of
        an older epoch is let go of unused)."""
        mirror = self._mirror
        if mirror is not None and self._launch.done(mirror[0]):
            self._mirror = None
            _, counts, offered, epoch = mirror
            if epoch == self._epoch:
                self._bound = min(self._bound, int(counts[1]) + (self._offered - offered))

    def _copy_counts_back(self) -> None:
        """Queue the asynchronous copy of the device counts (one at a time; no wait)."""
        self._take_landed_copy()
        if self._mirror is None and self._counts is not None:
            counts = self._launch.host_empty((2,), np.int64)
            self._launch.to_host_async(self._counts, counts)
            self._mirror = (self._launch.record(), counts, self._offered, self._epoch)

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
        ``out[out_rows]`` when ``rows`` is given (``hash_find.find``)."""
        return hash_find.find(self._launch, self._table, keys, rows, out, out_rows)

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
        return self._find(keys, rows, out, out_rows)[0]      # the lines' widths: checked there

    def find_live(self, keys, live, rows=None, out=None):
        """``find`` of a fixed-capacity batch (``device_unique.unique_ids_fixed``): only the
        first ``live`` keys are looked up, without a read; with ``rows`` (R, L) float32, the line
        of found key i is copied into row i of ``out`` (n, L) float32 too. keys: (n,) uint64;
        live: (1,) int64 device count -> slots (n,) int64: the slot, -1 where absent,
        ``NOT_LOOKED_UP`` (-2) from ``live`` on."""
        return hash_find.find_live(self._launch, self._table, keys, live, rows, out)

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
        self._counts, self._bound = None, 0
        self._epoch += 1
