"""De-duplication and segment sums: the local halves of the ID and gradient shuffles.

``unique_ids`` keeps first-occurrence order and returns the inverse index, from a numba hash table
(measured ~4x faster than ``np.unique(return_inverse=True)``, which sorts; DESIGN.md decision 1).
``segment_sum`` is the gradient shuffle's reduction: duplicates' gradients summed in row order,
so the result does not depend on thread count or store. Both kernels release the GIL.

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


@njit(cache=True, nogil=True)
def _segment_sum(values, inverse, out):
    for i in range(values.shape[0]):
        o = inverse[i]
        for j in range(values.shape[1]):
            out[o, j] += values[i, j]


def segment_sum(values: np.ndarray, inverse: np.ndarray, n_segments: int,
                launch=None) -> np.ndarray:
    """values: (n, E) float32, inverse: (n,) int64 in [0, n_segments) -> (n_segments, E) float32.

    Sums in row order, so the result is deterministic.
    """
    if launch is not None:
        # the inverse comes from unique_ids, as on the CPU (whose kernel checks nothing)
        return device_unique.segment_sum(values, inverse, n_segments, launch, check_inverse=False)
    out = np.zeros((n_segments, values.shape[1]), values.dtype)
    _segment_sum(np.ascontiguousarray(values), np.ascontiguousarray(inverse, np.int64), out)
    return out
