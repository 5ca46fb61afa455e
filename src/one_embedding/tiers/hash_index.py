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


@njit(cache=True, nogil=True)
def _find(table_keys, table_slots, keys, out_slots):
    mask = table_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        out_slots[i] = table_slots[_probe(table_keys, table_slots, keys[i], mask)]


@njit(cache=True, nogil=True)
def _assign(table_keys, table_slots, keys, slots):
    """Insert or overwrite key -> slot; returns how many keys were new."""
    mask = table_keys.shape[0] - 1
    n_new = 0
    for i in range(keys.shape[0]):
        b = _probe(table_keys, table_slots, keys[i], mask)
        if table_slots[b] == EMPTY:
            table_keys[b] = keys[i]
            n_new += 1
        table_slots[b] = slots[i]
    return n_new


@njit(cache=True, nogil=True)
def _find_or_insert(table_keys, table_slots, keys, next_slot, free_slots, n_free, out_slots, out_new):
    """Slots of ``keys``; a new key takes a free slot (LIFO from ``free_slots[:n_free]``) or
    ``next_slot``, ``next_slot + 1``, ... Returns (next_slot, n_free)."""
    mask = table_keys.shape[0] - 1
    for i in range(keys.shape[0]):
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
        out_slots[i] = s
    return next_slot, n_free


@njit(cache=True, nogil=True)
def _erase(table_keys, table_slots, keys, out_slots):
    """Remove keys (backward-shift deletion); ``out_slots[i]`` is the freed slot or -1."""
    mask = table_keys.shape[0] - 1
    n_erased = 0
    for i in range(keys.shape[0]):
        b = _probe(table_keys, table_slots, keys[i], mask)
        out_slots[i] = table_slots[b]
        if table_slots[b] == EMPTY:
            continue
        n_erased += 1
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
    return n_erased


@njit(cache=True, nogil=True)
def _occupied(table_keys, table_slots, out_keys, out_slots):
    n = 0
    for b in range(table_keys.shape[0]):
        if table_slots[b] != EMPTY:
            out_keys[n] = table_keys[b]
            out_slots[n] = table_slots[b]
            n += 1
    return n


@njit(cache=True, nogil=True)
def _copy_found_rows(rows, slots, out, out_rows, missing):
    """out[out_rows[i]] = rows[slots[i]] where slots[i] >= 0; the other i go to ``missing``."""
    n_missing = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            missing[n_missing] = i
            n_missing += 1
        else:
            r = out_rows[i]
            for c in range(out.shape[1]):
                out[r, c] = rows[s, c]
    return n_missing


def copy_found_rows(rows: np.ndarray, slots: np.ndarray, out: np.ndarray,
                    out_rows: np.ndarray) -> np.ndarray:
    """The gather behind ``Tier.find`` for rows kept in an array.

    rows: (R, L) float32; slots: (n,) int64 from ``HashIndex.find`` (-1 = absent); out: (N, L)
    float32; out_rows: (n,) int64. Copies ``rows[slots[i]]`` into ``out[out_rows[i]]`` and returns
    the ascending indices (m,) int64 of the absent keys.
    """
    missing = np.empty(slots.shape[0], np.int64)
    n = _copy_found_rows(rows, slots, out, np.ascontiguousarray(out_rows, np.int64), missing)
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
    """

    def __init__(self, expected_keys: int = 0):
        self._allocate(_capacity_for(max(int(expected_keys), 1)))
        self._size = 0
        self._next_slot = 0
        self._free = np.empty(16, np.int64)
        self._n_free = 0

    def _allocate(self, cap: int) -> None:
        # a bucket's key and slot sit side by side (one cache line per probe, not two); the
        # kernels see them as two strided views
        self._table = host_arrays.full((cap, 2), EMPTY, np.int64)
        self._keys = self._table[:, 0].view(np.uint64)
        self._slots = self._table[:, 1]

    def __len__(self) -> int:
        return self._size

    @property
    def slot_limit(self) -> int:
        """One past the highest slot ever handed out: the rows the backing storage must hold."""
        return self._next_slot

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._free.nbytes

    def _reserve(self, extra: int) -> None:
        need = self._size + extra
        if need <= self._keys.shape[0] * MAX_LOAD:
            return
        keys, slots = self.items()
        self._allocate(_capacity_for(need))
        _assign(self._keys, self._slots, keys, slots)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64 -> slots (n,) int64, -1 where absent."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.empty(keys.shape[0], np.int64)
        _find(self._keys, self._slots, keys, out)
        return out

    def find_or_insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64, unique -> (slots (n,) int64, is_new (n,) bool)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        self._reserve(keys.shape[0])
        slots = np.empty(keys.shape[0], np.int64)
        is_new = np.empty(keys.shape[0], np.bool_)
        self._next_slot, self._n_free = _find_or_insert(
            self._keys, self._slots, keys, self._next_slot, self._free, self._n_free, slots, is_new
        )
        self._size += int(is_new.sum())
        return slots, is_new

    def assign(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Insert or overwrite key -> slot (for restoring an index exactly as it was saved)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        slots = np.ascontiguousarray(slots, np.int64)
        self._reserve(keys.shape[0])
        self._size += int(_assign(self._keys, self._slots, keys, slots))
        if slots.size:
            self._next_slot = max(self._next_slot, int(slots.max()) + 1)

    def erase(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys; returns the slots they held (-1 for absent keys). Slots become reusable."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.empty(keys.shape[0], np.int64)
        self._size -= int(_erase(self._keys, self._slots, keys, out))
        freed = out[out != EMPTY]
        if freed.size:
            if self._n_free + freed.size > self._free.shape[0]:
                grown = np.empty(max(2 * self._free.shape[0], self._n_free + freed.size), np.int64)
                grown[: self._n_free] = self._free[: self._n_free]
                self._free = grown
            self._free[self._n_free : self._n_free + freed.size] = freed
            self._n_free += freed.size
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys (n,) uint64, slots (n,) int64), in bucket order."""
        keys = np.empty(self._size, np.uint64)
        slots = np.empty(self._size, np.int64)
        n = _occupied(self._keys, self._slots, keys, slots)
        return keys[:n], slots[:n]

    def clear(self) -> None:
        self._slots.fill(EMPTY)
        self._size = 0
        self._next_slot = 0
        self._n_free = 0
