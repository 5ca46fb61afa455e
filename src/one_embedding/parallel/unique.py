"""De-duplication and segment sums: the local halves of the ID and gradient shuffles.

``unique_ids`` keeps first-occurrence order and returns the inverse index, from a numba hash table
(measured ~4x faster than ``np.unique(return_inverse=True)``, which sorts; DESIGN.md decision 1).
``segment_sum`` is the gradient shuffle's reduction: duplicates' gradients summed in a fixed tree
order (``segment_sum``'s docstring: row order within chunks of ``SUM_CHUNK`` rows, the chunks'
partials summed by the same rule), the same on the CPU and on the GPU, where a long segment's
chunks sum in parallel; so the result does not depend on thread count, store or device. Both
kernels release the GIL.

Each function takes ``launch=None``; a device launcher (``kernels.device_ops``, the embedding's
on a GPU) runs its device twin instead, on that launcher's arrays, with the same results.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..hashing import jit_mix64
from ..kernels import device_unique


@njit(cache=True, nogil=True)
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


def unique_ids(keys: np.ndarray, launch=None) -> tuple[np.ndarray, np.ndarray]:
    """keys: (n,) uint64 -> (unique (u,) uint64 in first-occurrence order, inverse (n,) int64)."""
    if launch is not None:
        return device_unique.unique_ids(keys, launch)
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


def first_occurrence(inverse: np.ndarray, n_unique: int, launch=None) -> np.ndarray:
    """inverse: (n,) int64 from ``unique_ids`` -> (n_unique,) int64 index of each unique key's first
    occurrence (writing in reverse order lets the earliest index win)."""
    if launch is not None:
        return device_unique.first_occurrence(inverse, n_unique, launch)
    first = np.empty(n_unique, np.int64)
    first[inverse[::-1]] = np.arange(inverse.shape[0] - 1, -1, -1)
    return first


#: The chunk of the segment sums' tree order (``device_unique.SUM_CHUNK``, ``oe::SUM_CHUNK``)
SUM_CHUNK = device_unique.SUM_CHUNK


@njit(cache=True, nogil=True)
def _tree_layout(inverse, n_segments):
    """-> (counts (S,) int64: rows per segment, first_partial (S,) int64: the row of ``_segment_sum``'s
    sums array where segment s's chunk partials start (n_segments + their running count), -1 for
    a segment of at most SUM_CHUNK rows, n_partials: their total)."""
    chunk = SUM_CHUNK                                   # a compile-time constant to numba
    counts = np.zeros(n_segments, np.int64)
    for i in range(inverse.shape[0]):
        counts[inverse[i]] += 1
    first_partial = np.full(n_segments, -1, np.int64)
    n_partials = 0
    for s in range(n_segments):
        if counts[s] > chunk:
            first_partial[s] = n_segments + n_partials
            n_partials += (counts[s] + chunk - 1) // chunk
    return counts, first_partial, n_partials


@njit(cache=True, nogil=True)
def _segment_sum(values, inverse, counts, first_partial, sums):
    """sums[:S] (zeros) += the tree-order sums of values' rows by segment (``segment_sum``);
    sums[S:] (zeros): the long segments' chunk partials (``_tree_layout``), scratch.

    One pass over the rows in row order: a row of a segment of at most SUM_CHUNK rows adds into
    the segment's row; a row of a longer one into its chunk's partial (row p of the segment into
    partial p // SUM_CHUNK, from +0). One array for both keeps that loop a single vectorised
    add. Then each long segment's partials are summed by the same rule in place (chunk q of a
    level into partial q, which its own chunk has been read from), until at most SUM_CHUNK
    remain, which add into its row from +0.
    """
    chunk = SUM_CHUNK                                   # a compile-time constant to numba
    n, dim = values.shape
    n_segments = counts.shape[0]
    seen = np.zeros(n_segments, np.int64)
    for i in range(n):
        o = inverse[i]
        target = o
        if first_partial[o] >= 0:
            target = first_partial[o] + seen[o] // chunk
            seen[o] += 1
        for j in range(dim):
            sums[target, j] += values[i, j]
    acc = np.zeros(dim, values.dtype)
    for s in range(n_segments):
        base = first_partial[s]
        if base < 0:
            continue
        m = (counts[s] + chunk - 1) // chunk
        while m > chunk:
            above = (m + chunk - 1) // chunk
            for q in range(above):
                acc[:] = 0
                for k in range(q * chunk, min(q * chunk + chunk, m)):
                    for j in range(dim):
                        acc[j] += sums[base + k, j]
                for j in range(dim):
                    sums[base + q, j] = acc[j]
            m = above
        for k in range(m):
            for j in range(dim):
                sums[s, j] += sums[base + k, j]


def segment_sum(values: np.ndarray, inverse: np.ndarray, n_segments: int,
                launch=None) -> np.ndarray:
    """values: (n, E) float32 (or float64), inverse: (n,) int64 in [0, n_segments) ->
    (n_segments, E) of values' dtype.

    The sum of one segment's rows r_0..r_{L-1} (in row order) is defined in a fixed tree order:
    L <= ``SUM_CHUNK`` (32): added in row order from +0 in values' dtype; else the rows split
    into consecutive chunks of ``SUM_CHUNK`` (the last may be shorter), each summed in row order
    from +0, and the list of the chunk partials summed by this same rule, recursively (10^5 rows
    -> 3125 partials -> 98 -> 4 -> one). Deterministic, and the device twin
    (``device_unique.segment_sum``) sums in exactly this order, its long segments' chunks in
    parallel, so both give the same bits.
    """
    if launch is not None:
        # the inverse comes from unique_ids, as on the CPU (whose kernel checks nothing)
        return device_unique.segment_sum(values, inverse, n_segments, launch, check_inverse=False)
    inverse = np.ascontiguousarray(inverse, np.int64)
    counts, first_partial, n_partials = _tree_layout(inverse, int(n_segments))
    sums = np.zeros((n_segments + n_partials, values.shape[1]), values.dtype)
    _segment_sum(np.ascontiguousarray(values), inverse, counts, first_partial, sums)
    return sums[:n_segments]
