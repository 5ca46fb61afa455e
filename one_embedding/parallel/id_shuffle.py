"""ID shuffle: de-duplicate a batch's keys and partition them by owning rank.

``unique_ids`` keeps first-occurrence order and returns the inverse index, from a numba hash table
(measured ~4x faster than ``np.unique(return_inverse=True)``, which sorts; DESIGN.md decision 1).
``owner_rank`` is XXH64 of the key's 8 little-endian bytes with seed 1, modulo the world size
(REFERENCE.md "Distribution"), evaluated vectorised in uint64 arithmetic.
``segment_sum`` is the gradient shuffle's reduction: duplicates' gradients summed in batch order,
so the result does not depend on thread count or store.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ..hashing import jit_mix64
from ..hashing import xxh64_u64 as _xxh64_u64

#: XXH64 seed of the owner-rank hash (REFERENCE.md "Distribution").
OWNER_SEED = 1


def xxh64_u64(keys: np.ndarray, seed: int = OWNER_SEED) -> np.ndarray:
    """XXH64 of each key's 8 little-endian bytes (``hashing.xxh64_u64``), by default with the
    owner-rank seed. keys: (n,) uint64 -> (n,) uint64."""
    return _xxh64_u64(keys, seed)


def owner_rank(keys: np.ndarray, world: int) -> np.ndarray:
    """Rank that owns each key: XXH64(key, seed=1) % world. keys: (n,) uint64 -> (n,) int64."""
    if world == 1:
        return np.zeros(keys.shape[0], np.int64)
    return (_xxh64_u64(keys, OWNER_SEED) % np.uint64(world)).astype(np.int64)


@njit(cache=True)
def _unique_inverse(keys, table_keys, table_pos, unique_out, inverse):
    mask = table_keys.shape[0] - 1
    n_unique = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        b = np.int64(jit_mix64(k) & np.uint64(mask))
        while True:
            p = table_pos[b]
            if p < 0:
                table_keys[b] = k
                table_pos[b] = n_unique
                unique_out[n_unique] = k
                inverse[i] = n_unique
                n_unique += 1
                break
            if table_keys[b] == k:
                inverse[i] = p
                break
            b = (b + 1) & mask
    return n_unique


def unique_ids(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """keys: (n,) uint64 -> (unique (u,) uint64 in first-occurrence order, inverse (n,) int64)."""
    keys = np.ascontiguousarray(keys, np.uint64)
    n = keys.shape[0]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    table_keys = np.empty(cap, np.uint64)
    table_pos = np.full(cap, -1, np.int64)
    uniq = np.empty(n, np.uint64)
    inverse = np.empty(n, np.int64)
    u = _unique_inverse(keys, table_keys, table_pos, uniq, inverse)
    return uniq[:u], inverse


def first_occurrence(inverse: np.ndarray, n_unique: int) -> np.ndarray:
    """inverse: (n,) int64 from ``unique_ids`` -> (n_unique,) int64 index of each unique key's first
    occurrence (writing in reverse order lets the earliest index win)."""
    first = np.empty(n_unique, np.int64)
    first[inverse[::-1]] = np.arange(inverse.shape[0] - 1, -1, -1)
    return first


@njit(cache=True)
def _segment_sum(values, inverse, out):
    for i in range(values.shape[0]):
        o = inverse[i]
        for j in range(values.shape[1]):
            out[o, j] += values[i, j]


def segment_sum(values: np.ndarray, inverse: np.ndarray, n_segments: int) -> np.ndarray:
    """values: (n, E) float32, inverse: (n,) int64 in [0, n_segments) -> (n_segments, E) float32.

    Sums in row order, so the result is deterministic.
    """
    out = np.zeros((n_segments, values.shape[1]), values.dtype)
    _segment_sum(np.ascontiguousarray(values), np.ascontiguousarray(inverse, np.int64), out)
    return out


@dataclass
class ShuffledIds:
    """What the ID shuffle hands the lookup.

    unique_keys: (u,) uint64 keys this rank owns, de-duplicated (first-occurrence order)
    unique_table_ids: (u,) int32 table of each unique key (its first occurrence's)
    inverse: (n,) int64 position in unique_keys of each non-padding input id
    counts_per_rank: (world,) int64 unique ids sent to each owner rank (world = 1: [u])
    """

    unique_keys: np.ndarray
    unique_table_ids: np.ndarray
    inverse: np.ndarray
    counts_per_rank: np.ndarray


def shuffle_ids(keys: np.ndarray, table_ids: np.ndarray, world: int = 1) -> ShuffledIds:
    """De-duplicate ``keys`` (n,) uint64 with their ``table_ids`` (n,) int32 and partition by owner.

    With world = 1 the exchange is the identity; the partition step runs all the same, so a
    communicator plugs in between the partition and the second de-duplication without reshaping
    this code.
    """
    uniq, inverse = unique_ids(keys)
    uniq_tables = table_ids[first_occurrence(inverse, uniq.shape[0])].astype(np.int32)
    owners = owner_rank(uniq, world)
    counts = np.bincount(owners, minlength=world).astype(np.int64)
    if world > 1:
        order = np.argsort(owners, kind="stable")
        uniq, uniq_tables = uniq[order], uniq_tables[order]
        position = np.empty_like(order)
        position[order] = np.arange(order.shape[0])
        inverse = position[inverse]
    return ShuffledIds(uniq, uniq_tables, inverse, counts)
