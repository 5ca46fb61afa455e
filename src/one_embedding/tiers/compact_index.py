"""A key -> location directory in ~5-7 bytes a key, whose keys live elsewhere (on the SSD).

An SSD table cannot afford a full key in RAM for every row (8 bytes for the key alone, 16-35 with
a hash table around it). This directory keeps, per key, an 8-bit *tag* (hash bits the bucket
does not already imply) and the 32-bit *location* of its row: 5 bytes an entry. A tag match is
only a candidate; the caller owns the keys (the slot engine keeps them in per-segment key files)
and ``keys_of(locations) -> keys`` confirms it. A key that is not stored usually matches no tag
(about 8 x load / 256 = 3 % of the time one of its 8 candidate entries matches), so a lookup of
a new id rarely touches the key files and never reads a row.

Layout: bucketized cuckoo hashing, 4 entries a bucket, two candidate buckets a key (partial-key
cuckoo: the second bucket ``(H(tag) - b1) mod n_buckets`` is computed from an entry's bucket and
tag alone, so entries move without their keys). Any number of buckets works (the first bucket is
``(h * n_buckets) >> 32``), so the table grows by 15 % at a time and its RAM follows the key count
smoothly rather than doubling: between 0.80 and 0.92 load, 5.4-6.3 bytes a key. Growing needs the
keys again: ``keys_of`` is asked for every location, in location order (key files are read about
sequentially). A small stash takes the rare entry that 500 kicks cannot place.

Arrays: ``tags`` (n_buckets * 4 + STASH,) uint8 and ``locs`` (same,) uint32, ``EMPTY`` = free;
positions ``>= n_buckets * 4`` are the stash. Kernels are numba ``nogil`` functions.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from numba import njit

from ..hashing import jit_mix64

EMPTY = np.uint32(0xFFFFFFFF)
#: the largest location an entry can hold (EMPTY is reserved)
MAX_LOCATION = int(EMPTY) - 1
WAYS = 4
STASH = 64
MAX_LOAD = 0.92
GROWTH = 1.15
MAX_KICKS = 500
_MIN_BUCKETS = 64
_TAG_SALT = np.uint64(0x9E3779B97F4A7C15)

KeysOf = Callable[[np.ndarray], np.ndarray]


@njit(cache=True, nogil=True, inline="always")
def _parts(key, n_buckets):
    """(first bucket, tag) of a key."""
    h = jit_mix64(key)
    b1 = np.int64(((h & np.uint64(0xFFFFFFFF)) * np.uint64(n_buckets)) >> np.uint64(32))
    return b1, np.uint8((h >> np.uint64(40)) & np.uint64(0xFF))


@njit(cache=True, nogil=True, inline="always")
def _alt(bucket, tag, n_buckets):
    """The other bucket of an entry: an involution, alt(alt(b)) == b."""
    h = np.int64(jit_mix64(np.uint64(tag) + _TAG_SALT) % np.uint64(n_buckets))
    return (h + n_buckets - bucket) % n_buckets


@njit(cache=True, nogil=True)
def _count_candidates(tags, locs, n_buckets, keys, counts):
    """counts[i]: entries whose tag matches keys[i] in its two buckets and the stash."""
    stash0 = n_buckets * WAYS
    for i in range(keys.shape[0]):
        b1, tag = _parts(keys[i], n_buckets)
        b2 = _alt(b1, tag, n_buckets)
        c = 0
        for j in range(WAYS):
            p = b1 * WAYS + j
            if locs[p] != EMPTY and tags[p] == tag:
                c += 1
        if b2 != b1:
            for j in range(WAYS):
                p = b2 * WAYS + j
                if locs[p] != EMPTY and tags[p] == tag:
                    c += 1
        for p in range(stash0, locs.shape[0]):
            if locs[p] != EMPTY and tags[p] == tag:
                c += 1
        counts[i] = c


@njit(cache=True, nogil=True)
def _fill_candidates(tags, locs, n_buckets, keys, starts, out_pos):
    """The positions counted by ``_count_candidates``, key i's at out_pos[starts[i]:]."""
    stash0 = n_buckets * WAYS
    for i in range(keys.shape[0]):
        b1, tag = _parts(keys[i], n_buckets)
        b2 = _alt(b1, tag, n_buckets)
        k = starts[i]
        for j in range(WAYS):
            p = b1 * WAYS + j
            if locs[p] != EMPTY and tags[p] == tag:
                out_pos[k] = p
                k += 1
        if b2 != b1:
            for j in range(WAYS):
                p = b2 * WAYS + j
                if locs[p] != EMPTY and tags[p] == tag:
                    out_pos[k] = p
                    k += 1
        for p in range(stash0, locs.shape[0]):
            if locs[p] != EMPTY and tags[p] == tag:
                out_pos[k] = p
                k += 1


@njit(cache=True, nogil=True)
def _positions_of(tags, locs, n_buckets, keys, want, out_pos):
    """out_pos[i]: the position holding location want[i] among key i's candidates, or -1 (the
    location names one row, so no key comparison is needed)."""
    stash0 = n_buckets * WAYS
    for i in range(keys.shape[0]):
        b1, tag = _parts(keys[i], n_buckets)
        b2 = _alt(b1, tag, n_buckets)
        w = np.uint32(want[i])
        found = -1
        for j in range(WAYS):
            p = b1 * WAYS + j
            if locs[p] == w and tags[p] == tag:
                found = p
        if found < 0:
            for j in range(WAYS):
                p = b2 * WAYS + j
                if locs[p] == w and tags[p] == tag:
                    found = p
        if found < 0:
            for p in range(stash0, locs.shape[0]):
                if locs[p] == w and tags[p] == tag:
                    found = p
        out_pos[i] = found


@njit(cache=True, nogil=True)
def _insert(tags, locs, n_buckets, keys, new_locs, seed):
    """Place (tag of keys[i], new_locs[i]) for every i (the keys are not in the table).

    Returns (placed, in-hand tag, in-hand location): ``placed < n`` when an entry found no room
    (the stash full too); entries 0..placed-1 are in and the in-hand one must be re-inserted
    (it is a displaced entry, or entry ``placed`` itself) after the table grows."""
    state = np.uint64(seed) | np.uint64(1)
    stash0 = n_buckets * WAYS
    for i in range(keys.shape[0]):
        b, tag = _parts(keys[i], n_buckets)
        loc = np.uint32(new_locs[i])
        for kick in range(MAX_KICKS + 1):
            b2 = _alt(b, tag, n_buckets)
            placed = False
            for bucket in (b, b2):
                for j in range(WAYS):
                    p = bucket * WAYS + j
                    if locs[p] == EMPTY:
                        tags[p] = tag
                        locs[p] = loc
                        placed = True
                        break
                if placed:
                    break
            if placed:
                break
            if kick == MAX_KICKS:  # no room within the kicks: the stash, or give up
                for p in range(stash0, locs.shape[0]):
                    if locs[p] == EMPTY:
                        tags[p] = tag
                        locs[p] = loc
                        placed = True
                        break
                if not placed:
                    return i, tag, loc
                break
            # evict a pseudo-random entry of one of the two buckets and carry it to its other one
            state ^= state << np.uint64(13)
            state ^= state >> np.uint64(7)
            state ^= state << np.uint64(17)
            victim_bucket = b if (state >> np.uint64(40)) & np.uint64(1) else b2
            p = victim_bucket * WAYS + np.int64(state % np.uint64(WAYS))
            tags[p], tag = tag, tags[p]
            locs[p], loc = loc, locs[p]
            b = _alt(victim_bucket, tag, n_buckets)
    return keys.shape[0], np.uint8(0), EMPTY


@njit(cache=True, nogil=True)
def _occupied(locs, out):
    n = 0
    for p in range(locs.shape[0]):
        if locs[p] != EMPTY:
            out[n] = p
            n += 1
    return n


def _buckets_for(n_keys: int) -> int:
    return max(_MIN_BUCKETS, -(-int(n_keys / MAX_LOAD) // WAYS))


class CompactIndex:
    """uint64 key -> uint32 location, with the keys kept by the caller (``keys_of``).

    ``keys_of(locations (m,) int64) -> keys (m,) uint64`` must answer for every location held,
    and for the new locations of an ``upsert`` before the call (the rows are written first).
    """

    def __init__(self, expected_keys: int = 0):
        self._allocate(_buckets_for(expected_keys))
        self._size = 0
        self._seed = 0x2545F4914F6CDD1D

    def _allocate(self, n_buckets: int) -> None:
        self.n_buckets = int(n_buckets)
        self._tags = np.zeros(self.n_buckets * WAYS + STASH, np.uint8)
        self._locs = np.full(self.n_buckets * WAYS + STASH, EMPTY, np.uint32)

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return self._tags.nbytes + self._locs.nbytes

    @property
    def load(self) -> float:
        return self._size / (self.n_buckets * WAYS)

    # -- reads ----------------------------------------------------------------------------
    def _candidates(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(owner (c,) int64, positions (c,) int64): every entry whose tag matches a key."""
        counts = np.empty(keys.shape[0], np.int64)
        _count_candidates(self._tags, self._locs, self.n_buckets, keys, counts)
        starts = np.zeros(keys.shape[0], np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        pos = np.empty(int(counts.sum()), np.int64)
        _fill_candidates(self._tags, self._locs, self.n_buckets, keys, starts, pos)
        return np.repeat(np.arange(keys.shape[0], dtype=np.int64), counts), pos

    def positions(self, keys: np.ndarray, keys_of: KeysOf) -> np.ndarray:
        """keys: (n,) uint64 -> (n,) int64 position of each key's entry, -1 where absent."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.full(keys.shape[0], -1, np.int64)
        owner, pos = self._candidates(keys)
        if pos.shape[0]:
            match = keys_of(self._locs[pos].astype(np.int64)) == keys[owner]
            out[owner[match]] = pos[match]
        return out

    def find(self, keys: np.ndarray, keys_of: KeysOf) -> np.ndarray:
        """keys: (n,) uint64 -> locations (n,) int64, -1 where absent."""
        pos = self.positions(keys, keys_of)
        return self.locations_at(pos)

    def locations_at(self, pos: np.ndarray) -> np.ndarray:
        """pos: (n,) int64 from ``positions`` -> locations (n,) int64 (-1 where pos is -1)."""
        out = self._locs[np.maximum(pos, 0)].astype(np.int64)
        out[pos < 0] = -1
        return out

    def positions_of_locations(self, keys: np.ndarray, locations: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64, locations: (n,) int64 -> position (n,) int64 of the entry of
        ``keys[i]`` that holds ``locations[i]``, -1 where that row is no longer current."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.empty(keys.shape[0], np.int64)
        _positions_of(self._tags, self._locs, self.n_buckets, keys,
                      np.ascontiguousarray(locations, np.int64), out)
        return out

    def locations(self) -> np.ndarray:
        """Every held location (n,) int64, in table order."""
        pos = np.empty(self._size, np.int64)
        n = _occupied(self._locs, pos)
        return self._locs[pos[:n]].astype(np.int64)

    # -- writes ---------------------------------------------------------------------------
    def set_locations(self, pos: np.ndarray, locations: np.ndarray) -> None:
        """Move existing entries (pos from ``positions``) to new locations."""
        self._locs[pos] = np.asarray(locations, np.int64).astype(np.uint32)

    def erase_at(self, pos: np.ndarray) -> None:
        """Remove the entries at ``pos`` (from ``positions``; -1 ignored)."""
        pos = pos[pos >= 0]
        self._locs[pos] = EMPTY
        self._size -= int(pos.shape[0])

    def insert_new(self, keys: np.ndarray, locations: np.ndarray, keys_of: KeysOf) -> None:
        """Add keys (n,) uint64 that are not in the index, at locations (n,) int64."""
        keys = np.ascontiguousarray(keys, np.uint64)
        locations = np.ascontiguousarray(locations, np.int64)
        if keys.shape[0] == 0:
            return
        if locations.max() > MAX_LOCATION:
            raise OverflowError(f"location {int(locations.max())} exceeds {MAX_LOCATION}")
        if (self._size + keys.shape[0]) > MAX_LOAD * self.n_buckets * WAYS:
            self._grow(self._size + keys.shape[0], keys_of)
        start = 0
        while start < keys.shape[0]:
            self._seed += 1
            placed, tag, loc = _insert(self._tags, self._locs, self.n_buckets, keys[start:],
                                       locations[start:], self._seed)
            self._size += int(placed)
            start += int(placed)
            if start < keys.shape[0]:
                # the stash is full: key ``start`` is either in the table (it displaced the
                # entry in hand) or is itself in hand; a rebuild with the entry in hand (its key
                # comes from keys_of) holds it either way
                hand = np.array([int(loc)], np.int64)
                self._grow(self._size + keys.shape[0] - start, keys_of, extra=hand)
                start += 1

    def upsert(self, keys: np.ndarray, locations: np.ndarray, keys_of: KeysOf) -> np.ndarray:
        """keys: (n,) uint64 unique -> their entries now hold ``locations`` (n,) int64; returns
        the previous locations (n,) int64, -1 for keys that were new."""
        keys = np.ascontiguousarray(keys, np.uint64)
        locations = np.ascontiguousarray(locations, np.int64)
        pos = self.positions(keys, keys_of)
        old = self.locations_at(pos)
        known = pos >= 0
        self.set_locations(pos[known], locations[known])
        self.insert_new(keys[~known], locations[~known], keys_of)
        return old

    def _grow(self, need: int, keys_of: KeysOf, extra: np.ndarray | None = None) -> None:
        """Rebuild with room for ``need`` keys at MAX_LOAD / GROWTH; ``extra``: locations not in
        the table yet (an entry in hand) to place too."""
        held = self.locations()
        if extra is not None:
            held = np.concatenate([held, extra])
        n_buckets = max(_buckets_for(need * GROWTH), int(self.n_buckets * GROWTH) + 1)
        while True:
            self._allocate(n_buckets)
            if self._refill(held, keys_of):
                return
            n_buckets = int(n_buckets * GROWTH) + 1  # pathological: grow more

    def _refill(self, held: np.ndarray, keys_of: KeysOf, chunk: int = 1 << 20) -> bool:
        held = np.sort(held)  # location order: the key files are read near sequentially
        for start in range(0, held.shape[0], chunk):
            locs = held[start:start + chunk]
            self._seed += 1
            placed, _, _ = _insert(self._tags, self._locs, self.n_buckets, keys_of(locs), locs,
                                   self._seed)
            if placed < locs.shape[0]:
                return False
        self._size = int(held.shape[0])
        return True

    def clear(self) -> None:
        self._allocate(_MIN_BUCKETS)
        self._size = 0
