"""Key -> slot hash index: open addressing with linear probing, compiled with numba.

The host-memory store and the slot-file SSD engine keep their rows in a plain array (or file)
and find them through this index; the RocksDB engine keeps its key set in one (DESIGN.md
decision 5). numpy cannot vectorise probing, so the hot loops are numba functions at module
level compiled with ``cache=True, nogil=True``: they release the GIL, so a lookup on a
background thread runs beside the main thread's numpy work.

Layout: one ``(cap, 2)`` int64 table, ``cap`` a power of two, a bucket's key and slot side by side
so a probe reads one cache line; the kernels see it as ``table_keys (cap,) uint64`` and
``table_slots (cap,) int64`` (strided views). ``table_slots == -1`` marks an empty bucket, so
every uint64 value is a valid key. Deletion uses backward-shift, so there are no tombstones and
probe chains stay short.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..hashing import jit_mix64
from . import host_arrays

EMPTY = -1
MAX_LOAD = 0.7


@njit(cache=True, nogil=True, inline="always")
def _bucket(key, mask):
    # the splitmix64 finalizer spreads sequential ids (Criteo offsets) over the table
    return np.int64(jit_mix64(key) & np.uint64(mask))


@njit(cache=True, nogil=True, inline="always")
def _probe(table_keys, table_slots, key, mask):
    """The bucket holding ``key``, or the empty bucket where it would go."""
    b = _bucket(key, mask)
    while table_slots[b] != EMPTY and table_keys[b] != key:
        b = (b + 1) & mask
    return b


#: ``meta``, the index's counters, kept in a (3,) int64 array that the kernels update
#: themselves (with the table, inside one call): a KeyboardInterrupt (or any exception) between
#: a kernel and a Python statement cannot leave the count and the buckets disagreeing
SIZE, NEXT_SLOT, N_FREE = 0, 1, 2


@njit(cache=True, nogil=True)
def _find(table_keys, table_slots, keys, out_slots):
    if out_slots.shape[0] < keys.shape[0]:
        raise ValueError("hash index: the output of find is shorter than its keys")
    mask = table_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        out_slots[i] = table_slots[_probe(table_keys, table_slots, keys[i], mask)]


@njit(cache=True, nogil=True)
def _assign(table_keys, table_slots, keys, slots, meta):
    """Insert or overwrite key -> slot; ``meta``: SIZE counts the new keys, NEXT_SLOT passes the
    highest slot."""
    if slots.shape[0] < keys.shape[0]:
        raise ValueError("hash index: assign has fewer slots than keys")
    if meta[SIZE] < 0 or meta[SIZE] + keys.shape[0] >= table_keys.shape[0]:
        raise RuntimeError("hash index: its size does not fit its table (inconsistent state)")
    mask = table_keys.shape[0] - 1
    n_new = 0
    top = meta[NEXT_SLOT]
    for i in range(keys.shape[0]):
        b = _probe(table_keys, table_slots, keys[i], mask)
        if table_slots[b] == EMPTY:
            table_keys[b] = keys[i]
            n_new += 1
        table_slots[b] = slots[i]
        if slots[i] + 1 > top:
            top = slots[i] + 1
    meta[SIZE] += n_new
    meta[NEXT_SLOT] = top


@njit(cache=True, nogil=True)
def _find_or_insert(table_keys, table_slots, meta, free_slots, keys, out_slots, out_new):
    """Slots of ``keys``; a new key takes a free slot (LIFO from ``free_slots[:meta[N_FREE]]``)
    or ``meta[NEXT_SLOT]``, ``+ 1``, ... The counters in ``meta`` are updated here, with the
    table."""
    n = keys.shape[0]
    if out_slots.shape[0] < n or out_new.shape[0] < n:
        raise ValueError("hash index: the outputs of find_or_insert are shorter than its keys")
    size, next_slot, n_free = meta[SIZE], meta[NEXT_SLOT], meta[N_FREE]
    if size < 0 or size + n >= table_keys.shape[0] or n_free < 0 \
            or n_free > free_slots.shape[0]:
        raise RuntimeError("hash index: its counters do not fit its arrays (inconsistent state)")
    mask = table_keys.shape[0] - 1
    for i in range(n):
        b = _probe(table_keys, table_slots, keys[i], mask)
        s = table_slots[b]
        out_new[i] = s == EMPTY
        if s == EMPTY:
            if n_free > 0:
                n_free -= 1
                s = free_slots[n_free]
            else:
                s = next_slot
                next_slot += 1
            table_keys[b] = keys[i]
            table_slots[b] = s
            size += 1
        out_slots[i] = s
    meta[SIZE], meta[NEXT_SLOT], meta[N_FREE] = size, next_slot, n_free


@njit(cache=True, nogil=True)
def _erase(table_keys, table_slots, meta, free_slots, keys, out_slots):
    """Remove keys (backward-shift deletion); ``out_slots[i]`` is the freed slot or -1. Freed
    slots go onto ``free_slots`` (which must have room for every key) and ``meta`` here."""
    n = keys.shape[0]
    if out_slots.shape[0] < n:
        raise ValueError("hash index: the output of erase is shorter than its keys")
    size, n_free = meta[SIZE], meta[N_FREE]
    if n_free < 0 or n_free + n > free_slots.shape[0]:
        raise RuntimeError("hash index: no room for the freed slots (inconsistent state)")
    mask = table_keys.shape[0] - 1
    for i in range(n):
        b = _probe(table_keys, table_slots, keys[i], mask)
        out_slots[i] = table_slots[b]
        if table_slots[b] == EMPTY:
            continue
        free_slots[n_free] = table_slots[b]
        n_free += 1
        size -= 1
        # shift later members of the probe chain back into the hole
        hole = b
        j = (b + 1) & mask
        while table_slots[j] != EMPTY:
            home = _bucket(table_keys[j], mask)
            # move j into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and (home <= hole and home > j)):
                table_keys[hole] = table_keys[j]
                table_slots[hole] = table_slots[j]
                hole = j
            j = (j + 1) & mask
        table_slots[hole] = EMPTY
    meta[SIZE], meta[N_FREE] = size, n_free


@njit(cache=True, nogil=True)
def _occupied(table_keys, table_slots, out_keys, out_slots):
    """Copies the occupied buckets into the outputs, as many as fit; returns how many buckets
    are occupied (more than the outputs hold: the caller's count was wrong, nothing written past
    their ends)."""
    room = min(out_keys.shape[0], out_slots.shape[0])
    n = 0
    for b in range(table_keys.shape[0]):
        if table_slots[b] != EMPTY:
            if n < room:
                out_keys[n] = table_keys[b]
                out_slots[n] = table_slots[b]
            n += 1
    return n


@njit(cache=True, nogil=True)
def _copy_found_rows(rows, slots, out, out_rows, missing):
    """out[out_rows[i]] = rows[slots[i]] where slots[i] >= 0; the other i go to ``missing``.
    Returns the count of missing, or -1 (nothing written past an array) when a slot or an
    out_row lies outside its array."""
    if out.shape[1] > rows.shape[1] or out_rows.shape[0] < slots.shape[0] \
            or missing.shape[0] < slots.shape[0]:
        return -1
    n_missing = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            missing[n_missing] = i
            n_missing += 1
        else:
            r = out_rows[i]
            if s >= rows.shape[0] or r < 0 or r >= out.shape[0]:
                return -1
            for c in range(out.shape[1]):
                out[r, c] = rows[s, c]
    return n_missing


def copy_found_rows(rows: np.ndarray, slots: np.ndarray, out: np.ndarray,
                    out_rows: np.ndarray) -> np.ndarray:
    """The gather behind ``Tier.find`` for rows kept in an array.

    rows: (R, L) float32; slots: (n,) int64 from ``HashIndex.find`` (-1 = absent); out: (N, L)
    float32; out_rows: (n,) int64. Copies ``rows[slots[i]]`` into ``out[out_rows[i]]`` and returns
    the ascending indices (m,) int64 of the absent keys. A slot past ``rows`` or an out_row past
    ``out`` is an IndexError (nothing is written out of bounds).
    """
    missing = np.empty(slots.shape[0], np.int64)
    out_rows = np.ascontiguousarray(out_rows, np.int64)
    n = _copy_found_rows(rows, slots, out, out_rows, missing)
    if n < 0:
        raise IndexError(
            f"copy_found_rows: a slot or output row lies outside its array (rows {rows.shape}, "
            f"out {out.shape}, {slots.shape[0]} slots, {out_rows.shape[0]} output rows)")
    return missing[:n]


def _capacity_for(n_keys: int) -> int:
    cap = 16
    while cap * MAX_LOAD < n_keys:
        cap *= 2
    return cap


class HashIndex:
    """Maps uint64 keys to int64 row slots; grows (rehashes) before the load passes 0.7.

    Slots are handed out densely from 0 and freed slots are reused, so the rows array (or file)
    behind the index never holds more rows than the index ever held at once.

    Interrupt safety (a KeyboardInterrupt lands between any two Python statements): the whole
    state is one tuple ``_st = (table, keys view, slots view, meta, free)``. A kernel changes the
    table, the counters in ``meta`` and the free list together, inside one call; a change of
    arrays (growth, a longer free list, clear) builds the new ones aside and replaces the tuple
    in one assignment. So after an interrupt anywhere the index is the one before the call or
    the one after it, never a mix.
    """

    def __init__(self, expected_keys: int = 0):
        self._st = self._fresh(_capacity_for(max(int(expected_keys), 1)),
                               np.zeros(3, np.int64), np.empty(16, np.int64))

    @staticmethod
    def _fresh(cap: int, meta: np.ndarray, free: np.ndarray) -> tuple:
        # a bucket's key and slot sit side by side (one cache line per probe, not two); the
        # kernels see them as two strided views
        table = host_arrays.full((cap, 2), EMPTY, np.int64)
        return table, table[:, 0].view(np.uint64), table[:, 1], meta, free

    # the arrays of the current state (read-only use: tests and diagnostics)
    @property
    def _table(self) -> np.ndarray:
        return self._st[0]

    @property
    def _keys(self) -> np.ndarray:
        return self._st[1]

    @property
    def _slots(self) -> np.ndarray:
        return self._st[2]

    def __len__(self) -> int:
        return int(self._st[3][SIZE])

    @property
    def slot_limit(self) -> int:
        """One past the highest slot ever handed out: the rows the backing storage must hold."""
        return int(self._st[3][NEXT_SLOT])

    @property
    def nbytes(self) -> int:
        return self._st[0].nbytes + self._st[4].nbytes

    def _reserve(self, extra: int) -> tuple:
        """The state, grown first (a new table swapped in whole) if ``extra`` more keys would
        pass MAX_LOAD."""
        st = self._st
        need = int(st[3][SIZE]) + extra
        if need <= st[1].shape[0] * MAX_LOAD:
            return st
        keys, slots = self.items()
        new = self._fresh(_capacity_for(need), st[3], st[4])
        _assign(new[1], new[2], keys, slots, np.zeros(3, np.int64))  # counters unchanged
        self._st = new
        return new

    def find(self, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64 -> slots (n,) int64, -1 where absent."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.empty(keys.shape[0], np.int64)
        st = self._st
        _find(st[1], st[2], keys, out)
        return out

    def find_or_insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64, unique -> (slots (n,) int64, is_new (n,) bool)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        _, tk, ts, meta, free = self._reserve(keys.shape[0])
        slots = np.empty(keys.shape[0], np.int64)
        is_new = np.empty(keys.shape[0], np.bool_)
        _find_or_insert(tk, ts, meta, free, keys, slots, is_new)
        return slots, is_new

    def assign(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert or overwrite key -> slot (for restoring an index exactly as it was saved)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        slots = np.ascontiguousarray(slots, np.int64)
        if slots.shape[0] != keys.shape[0]:
            raise ValueError(f"assign: {keys.shape[0]} keys but {slots.shape[0]} slots")
        _, tk, ts, meta, _ = self._reserve(keys.shape[0])
        _assign(tk, ts, keys, slots, meta)

    def erase(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; returns the slots they held (-1 for absent keys). Slots become reusable."""
        keys = np.ascontiguousarray(keys, np.uint64)
        st = self._st
        table, tk, ts, meta, free = st
        n_free = int(meta[N_FREE])
        if n_free + keys.shape[0] > free.shape[0]:  # room for every key's slot, swapped in whole
            free = np.empty(max(2 * free.shape[0], n_free + keys.shape[0]), np.int64)
            free[:n_free] = st[4][:n_free]
            self._st = (table, tk, ts, meta, free)
        out = np.empty(keys.shape[0], np.int64)
        _erase(tk, ts, meta, free, keys, out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys (n,) uint64, slots (n,) int64), in bucket order."""
        _, tk, ts, meta, _ = self._st
        size = int(meta[SIZE])
        keys = np.empty(size, np.uint64)
        slots = np.empty(size, np.int64)
        n = _occupied(tk, ts, keys, slots)
        if n != size:
            raise RuntimeError(f"hash index: {n} buckets are occupied but its size is {size} "
                               "(inconsistent state); rebuild it from a snapshot")
        return keys, slots

    def clear(self) -> None:
        st = self._st
        self._st = self._fresh(st[1].shape[0], np.zeros(3, np.int64), np.empty(16, np.int64))
