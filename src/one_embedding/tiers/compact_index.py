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
positions ``>= n_buckets * 4`` are the stash, its last position the *reserve* (below). Kernels are
numba ``nogil`` functions.

Interrupt safety (a KeyboardInterrupt lands between any two Python statements, never inside a
kernel): the whole state is one tuple ``(n_buckets, tags, locs, meta)`` swapped in one
assignment; ``meta[SIZE]``, the entry count, is kept by the kernels that change the table, in the
same call. An insert that finds no room never holds an entry outside the table: the one in hand
goes to the reserve, and the table grows (a new one built aside) before the next insert.
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


#: ``meta``: the counters, a (1,) int64 array the kernels update with the table
SIZE = 0


@njit(cache=True, nogil=True)
def _check_shape(tags, locs, n_buckets, meta):
    if tags.shape[0] != locs.shape[0] or locs.shape[0] != n_buckets * WAYS + STASH \
            or meta[SIZE] < 0 or meta[SIZE] > locs.shape[0]:
        raise RuntimeError("compact index: its arrays and counters disagree (inconsistent state)")


@njit(cache=True, nogil=True)
def _insert(tags, locs, n_buckets, keys, new_locs, seed, meta):
    """Place (tag of keys[i], new_locs[i]) for i = 0, 1, ... (the keys are not in the table);
    ``meta[SIZE]`` counts them. Returns how many are in: fewer than n when the table is full
    (the stash too): the entry then in hand (a displaced one, or keys[i]'s own) went to the
    reserve, the last stash position, so no entry is ever outside the table, and the caller
    grows the table before it inserts more. Nothing is placed while the reserve is taken."""
    _check_shape(tags, locs, n_buckets, meta)
    n = min(keys.shape[0], new_locs.shape[0])
    reserve = locs.shape[0] - 1
    if locs[reserve] != EMPTY:
        return 0
    state = np.uint64(seed) | np.uint64(1)
    stash0 = n_buckets * WAYS
    done = n
    for i in range(n):
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
            if kick == MAX_KICKS:  # no room within the kicks: the stash, else the reserve
                for p in range(stash0, reserve + 1):
                    if locs[p] == EMPTY:
                        tags[p] = tag
                        locs[p] = loc
                        placed = True
                        break
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
        meta[SIZE] += 1
        if locs[reserve] != EMPTY:  # the reserve is taken: grow before anything more
            done = i + 1
            break
    return done


@njit(cache=True, nogil=True)
def _occupied(locs, out):
    """Copies the occupied positions into ``out``, as many as fit; returns how many positions
    are occupied (more than ``out`` holds: the caller's count was wrong, nothing written past
    its end)."""
    room = out.shape[0]
    n = 0
    for p in range(locs.shape[0]):
        if locs[p] != EMPTY:
            if n < room:
                out[n] = p
            n += 1
    return n


@njit(cache=True, nogil=True)
def _erase_at(locs, pos, meta):
    """Free the entries at ``pos`` (-1, a position out of range or one already free: ignored)."""
    for i in range(pos.shape[0]):
        p = pos[i]
        if 0 <= p < locs.shape[0] and locs[p] != EMPTY:
            locs[p] = EMPTY
            meta[SIZE] -= 1


@njit(cache=True, nogil=True)
def _set_at(locs, pos, new_locs):
    """Move the entries at ``pos`` to ``new_locs`` (free or out-of-range positions ignored: an
    entry is never made here, so the count stays right)."""
    for i in range(min(pos.shape[0], new_locs.shape[0])):
        p = pos[i]
        if 0 <= p < locs.shape[0] and locs[p] != EMPTY:
            locs[p] = np.uint32(new_locs[i])


def _buckets_for(n_keys: int) -> int:
    return max(_MIN_BUCKETS, -(-int(n_keys / MAX_LOAD) // WAYS))


def _fresh(n_buckets: int) -> tuple:
    """A new, empty state tuple ``(n_buckets, tags, locs, meta)``."""
    n_buckets = int(n_buckets)
    return (n_buckets, np.zeros(n_buckets * WAYS + STASH, np.uint8),
            np.full(n_buckets * WAYS + STASH, EMPTY, np.uint32), np.zeros(1, np.int64))


class CompactIndex:
    """uint64 key -> uint32 location, with the keys kept by the caller (``keys_of``).

    ``keys_of(locations (m,) int64) -> keys (m,) uint64`` must answer for every location held,
    and for the new locations of an ``upsert`` before the call (the rows are written first).

    Interrupt safety: the state is one tuple ``_st = (n_buckets, tags, locs, meta)``; a kernel
    changes the table and ``meta[SIZE]`` together, growth and clear build a new tuple aside and
    swap it in one assignment. After a KeyboardInterrupt anywhere, every entry held before the
    call is held (at its old location or the new one) and the count agrees with the table; an
    interrupted ``insert_new`` / ``upsert`` has placed a prefix of its keys (the retry places
    the rest).
    """

    def __init__(self, expected_keys: int = 0):
        self._st = _fresh(_buckets_for(expected_keys))
        self._seed = 0x2545F4914F6CDD1D

    # the parts of the current state (read-only use)
    @property
    def n_buckets(self) -> int:
        return self._st[0]

    @property
    def _tags(self) -> np.ndarray:
        return self._st[1]

    @property
    def _locs(self) -> np.ndarray:
        return self._st[2]

    def __len__(self) -> int:
        return int(self._st[3][SIZE])

    @property
    def nbytes(self) -> int:
        st = self._st
        return st[1].nbytes + st[2].nbytes

    @property
    def load(self) -> float:
        st = self._st
        return int(st[3][SIZE]) / (st[0] * WAYS)

    # -- reads ----------------------------------------------------------------------------
    def _candidates(self, st: tuple, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(owner (c,) int64, positions (c,) int64): every entry whose tag matches a key."""
        n_buckets, tags, locs, _ = st
        counts = np.empty(keys.shape[0], np.int64)
        _count_candidates(tags, locs, n_buckets, keys, counts)
        starts = np.zeros(keys.shape[0], np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        pos = np.empty(int(counts.sum()), np.int64)
        _fill_candidates(tags, locs, n_buckets, keys, starts, pos)
        return np.repeat(np.arange(keys.shape[0], dtype=np.int64), counts), pos

    def positions(self, keys: np.ndarray, keys_of: KeysOf) -> np.ndarray:
        """keys: (n,) uint64 -> (n,) int64 position of each key's entry, -1 where absent."""
        keys = np.ascontiguousarray(keys, np.uint64)
        st = self._st
        out = np.full(keys.shape[0], -1, np.int64)
        owner, pos = self._candidates(st, keys)
        if pos.shape[0]:
            match = keys_of(st[2][pos].astype(np.int64)) == keys[owner]
            out[owner[match]] = pos[match]
        return out

    def find(self, keys: np.ndarray, keys_of: KeysOf) -> np.ndarray:
        """keys: (n,) uint64 -> locations (n,) int64, -1 where absent."""
        pos = self.positions(keys, keys_of)
        return self.locations_at(pos)

    def locations_at(self, pos: np.ndarray) -> np.ndarray:
        """pos: (n,) int64 from ``positions`` -> locations (n,) int64 (-1 where pos is -1)."""
        out = self._st[2][np.maximum(pos, 0)].astype(np.int64)
        out[pos < 0] = -1
        return out

    def positions_of_locations(self, keys: np.ndarray, locations: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64, locations: (n,) int64 -> position (n,) int64 of the entry of
        ``keys[i]`` that holds ``locations[i]``, -1 where that row is no longer current."""
        keys = np.ascontiguousarray(keys, np.uint64)
        locations = np.ascontiguousarray(locations, np.int64)
        if locations.shape[0] != keys.shape[0]:
            raise ValueError(f"{keys.shape[0]} keys but {locations.shape[0]} locations")
        n_buckets, tags, locs, _ = self._st
        out = np.empty(keys.shape[0], np.int64)
        _positions_of(tags, locs, n_buckets, keys, locations, out)
        return out

    def locations(self) -> np.ndarray:
        """Every held location (n,) int64, in table order."""
        _, _, locs, meta = self._st
        size = int(meta[SIZE])
        pos = np.empty(size, np.int64)
        n = _occupied(locs, pos)
        if n != size:
            raise RuntimeError(f"compact index: {n} entries are held but its size is {size} "
                               "(inconsistent state); load a snapshot")
        return locs[pos].astype(np.int64)

    # -- writes ---------------------------------------------------------------------------
    def set_locations(self, pos: np.ndarray, locations: np.ndarray) -> None:
        """Move existing entries (pos from ``positions``) to new locations."""
        pos = np.ascontiguousarray(pos, np.int64)
        locations = np.ascontiguousarray(locations, np.int64)
        if locations.shape[0] != pos.shape[0]:
            raise ValueError(f"{pos.shape[0]} positions but {locations.shape[0]} locations")
        if locations.shape[0] and locations.max() > MAX_LOCATION:
            raise OverflowError(f"location {int(locations.max())} exceeds {MAX_LOCATION}")
        _set_at(self._st[2], pos, locations)

    def erase_at(self, pos: np.ndarray) -> None:
        """Remove the entries at ``pos`` (from ``positions``; -1 ignored): all of them, in one
        kernel that keeps the count with the table."""
        _, _, locs, meta = self._st
        _erase_at(locs, np.ascontiguousarray(pos, np.int64), meta)

    def insert_new(self, keys: np.ndarray, locations: np.ndarray, keys_of: KeysOf) -> None:
        """Add keys (n,) uint64 that are not in the index, at locations (n,) int64."""
        keys = np.ascontiguousarray(keys, np.uint64)
        locations = np.ascontiguousarray(locations, np.int64)
        if keys.shape[0] == 0:
            return
        if locations.shape[0] != keys.shape[0]:
            raise ValueError(f"{keys.shape[0]} keys but {locations.shape[0]} locations")
        if locations.max() > MAX_LOCATION:
            raise OverflowError(f"location {int(locations.max())} exceeds {MAX_LOCATION}")
        st = self._st
        if int(st[3][SIZE]) + keys.shape[0] > MAX_LOAD * st[0] * WAYS:
            st = self._grow(int(st[3][SIZE]) + keys.shape[0], keys_of)
        start = 0
        while start < keys.shape[0]:
            n_buckets, tags, locs, meta = st
            if locs[-1] != EMPTY:  # the reserve is taken: the table is full
                st = self._grow(int(meta[SIZE]) + keys.shape[0] - start, keys_of)
                continue
            self._seed += 1
            start += int(_insert(tags, locs, n_buckets, keys[start:], locations[start:],
                                 self._seed, meta))

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

    def _grow(self, need: int, keys_of: KeysOf) -> tuple:
        """Rebuild with room for ``need`` keys at MAX_LOAD / GROWTH: a new state built aside
        (every held entry, the reserve's included) and swapped in whole. Returns it."""
        st = self._st
        held = self.locations()
        n_buckets = max(_buckets_for(need * GROWTH), int(st[0] * GROWTH) + 1)
        while True:
            new = self._refill(n_buckets, held, keys_of)
            if new is not None:
                self._st = new
                return new
            n_buckets = int(n_buckets * GROWTH) + 1  # pathological: grow more

    def _refill(self, n_buckets: int, held: np.ndarray, keys_of: KeysOf,
                chunk: int = 1 << 20) -> tuple | None:
        """A new state of ``n_buckets`` holding the locations ``held``, or None if they did not
        fit (the reserve was needed)."""
        new = _fresh(n_buckets)
        _, tags, locs, meta = new
        held = np.sort(held)  # location order: the key files are read near sequentially
        for start in range(0, held.shape[0], chunk):
            part = held[start:start + chunk]
            self._seed += 1
            placed = _insert(tags, locs, n_buckets, keys_of(part), part, self._seed, meta)
            if placed < part.shape[0] or locs[-1] != EMPTY:
                return None
        return new

    def clear(self) -> None:
        self._st = _fresh(_MIN_BUCKETS)
