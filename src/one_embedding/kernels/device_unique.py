"""The device twins of ``parallel.unique``: unique + inverse (a hash table in device memory, and
the sort-based baseline it replaced), first occurrences, and the segment sums of the gradient
shuffle, launching the kernels of ``cuda/embedding.cu``.

Every function takes ``launch``, a ``device_ops.Launcher`` (default: ``device_ops.cupy_launcher()``,
CuPy on the current device; the tests pass the host emulator's). Results equal the CPU twins in
``parallel.unique`` bit for bit (float32 subnormal sums flush to zero on the GPU).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import host_sync
from ..errors import InputError
from .device_ops import (Launcher, _float_dtype, device_array, launch_threads, launch_warps,
                         line_vector, resolve)


#: True: the one-rank device_mem path dedups and probes the store's index in one output pass
#: (``unique_ids_fixed_find``, under the tier chain's lock); False (the default): the dedup's own
#: output pass in the ID shuffle, then the store's separate find (the tests compare the two, bit
#: for bit). Off since two H200 runs (2026-11-27, bench_gpu's lookup of 1.7 M ids): the fused
#: pass took 0.512 / 0.517 ms against 0.473 / 0.476 for the two kernels, and the whole lookup
#: 2.06 / 2.05 ms against 1.98 / 2.00 (a warp per 32 ids probing in the output pass keeps fewer
#: loads in flight than the separate find's warp per key).
FIND_IN_DEDUP = False


def dedup_capacity(n: int) -> int:
    """Buckets of ``unique_ids``'s hash table for ``n`` ids: the smallest power of two of at least
    2n (at least 2), so the table is at most half full even when every id is distinct."""
    return 1 << max(1, (2 * int(n) - 1).bit_length())


def _empty_unique(xp, return_first: bool):
    empty = (xp.empty(0, xp.uint64), xp.empty(0, xp.int64))
    return empty + (xp.empty(0, xp.int64),) if return_first else empty


def unique_ids(keys, launch: Launcher | None = None, return_first: bool = False):
    """keys: (n,) uint64 -> (unique (u,) uint64 in first-occurrence order, inverse (n,) int64),
    and with ``return_first`` also first (u,) int64, the position of each unique key's first
    occurrence (``parallel.unique.first_occurrence``).

    Equals ``parallel.unique.unique_ids`` exactly, with no sort: a hash table in device memory
    (``dedup_capacity(n)`` buckets of 16 bytes, linear probing, the key equal to the empty marker
    in a side bucket; ``cuda/embedding.cu`` has the layout). A thread per id claims its key's
    bucket and lowers the bucket's first position to its own by an atomic minimum; a second pass
    flags each id that is its key's first occurrence; the inclusive prefix sum of the flags then
    numbers the keys in first-occurrence order, and a third pass writes the inverse, the unique
    keys and their first positions. Which bucket a key lands in depends on thread timing, the
    results do not. One counted host read, the unique count ("dedup: unique count"), sizes them.
    """
    launch = resolve(launch)
    xp = launch.xp
    keys = device_array(launch, "keys", keys, np.uint64, ndim=1)
    n = keys.shape[0]
    if n == 0:
        return _empty_unique(xp, return_first)
    first_of, rank = _dedup_passes(launch, keys)
    n_unique = host_sync.scalar(rank[-1], "dedup: unique count")
    uniq = xp.empty(n_unique, dtype=xp.uint64)
    first = xp.empty(n_unique, dtype=xp.int64)
    inverse = xp.empty(n, dtype=xp.int64)
    launch_threads(launch, "embedding", "dedup_output", np.float32, n,
                   (keys, first_of, rank, np.int64(n), inverse, uniq, first))
    if return_first:
        return uniq, inverse, first
    return uniq, inverse


class FixedUnique(NamedTuple):
    """``unique_ids_fixed``'s result: arrays of capacity n (the number of ids), the first
    ``count`` entries of ``keys`` and ``first`` those of ``unique_ids``.

    keys: (n,) uint64, the unique keys in first-occurrence order, then key 0 in positions
    count..n-1; inverse: (n,) int64, as ``unique_ids``'; first: (n,) int64, each unique key's
    first position, then 0; count: (1,) int64 device array, u, never read by the host here.
    """
    keys: object
    inverse: object
    first: object
    count: object


def _dedup_passes(launch, keys):
    """Passes 0-2 of the hash-table dedup and the numbering of the first occurrences ->
    (first_of (n,) int64: each id's first position, rank (n,) int64: the inclusive prefix sum
    of the first occurrences, so rank[n - 1] is the unique count). keys: (n,) uint64, n > 0."""
    xp = launch.xp
    n = keys.shape[0]
    capacity = dedup_capacity(n)
    table = xp.empty(2 * (capacity + 1), dtype=xp.uint64)           # (capacity + 1, 2) [key, first]
    launch_threads(launch, "embedding", "dedup_clear", np.float32, capacity + 1,
                   (table, np.int64(capacity + 1), np.int64(n)))
    first_of = xp.empty(n, dtype=xp.int64)                         # bucket, then first position
    launch_threads(launch, "embedding", "dedup_insert", np.float32, n,
                   (keys, np.int64(n), table, np.int64(capacity - 1), first_of))
    is_first = xp.empty(n, dtype=xp.uint8)
    launch_threads(launch, "embedding", "dedup_first", np.float32, n, (table, np.int64(n), first_of, is_first))
    return first_of, xp.cumsum(is_first, dtype=xp.int64)           # (n,) ids + 1 at first positions


class DedupPasses(NamedTuple):
    """The fixed-capacity dedup up to its output pass (``dedup_passes_fixed``): keys (n,) uint64
    (the batch's ids, device array), first_of (n,) int64 (each id's first position), rank (n,)
    int64 (the inclusive prefix sum of the first occurrences: rank[n - 1] is the unique count).
    first_of and rank are None when n == 0."""
    keys: object
    first_of: object
    rank: object


def dedup_passes_fixed(keys, launch: Launcher | None = None) -> DedupPasses:
    """keys: (n,) uint64 -> ``DedupPasses``: the fixed-capacity dedup's passes that read no
    store (the table, the first positions, their numbering); an output pass finishes it,
    ``unique_ids_fixed``'s or, fused with a store index's probe, ``unique_ids_fixed_find``."""
    launch = resolve(launch)
    keys = device_array(launch, "keys", keys, np.uint64, ndim=1)
    if keys.shape[0] == 0:
        return DedupPasses(keys, None, None)
    return DedupPasses(keys, *_dedup_passes(launch, keys))


def _fixed_outputs(xp, n: int):
    return xp.empty(n, dtype=xp.uint64), xp.empty(n, dtype=xp.int64), xp.empty(n, dtype=xp.int64)


def unique_ids_fixed(keys, launch: Launcher | None = None) -> FixedUnique:
    """keys: (n,) uint64 -> ``FixedUnique``: ``unique_ids(keys, return_first=True)`` written
    into arrays of capacity n (an upper bound of the unique count), the count kept on the
    device: no host read, so nothing waits for the device and a CUDA graph can hold it.

    The same kernels as ``unique_ids`` but the last (``dedup_output_fixed``), which also fills
    positions count..n-1 (key 0, first position 0: in bounds for any gather by them). The
    kernels after it on the device path take ``count`` and skip those positions. An empty
    batch gives empty arrays and a count of 0.
    """
    launch = resolve(launch)
    xp = launch.xp
    passes = dedup_passes_fixed(keys, launch)
    keys = passes.keys
    n = keys.shape[0]
    if n == 0:
        return FixedUnique(*_empty_unique(xp, True), xp.zeros(1, dtype=xp.int64))
    uniq, first, inverse = _fixed_outputs(xp, n)
    launch_threads(launch, "embedding", "dedup_output_fixed", np.float32, n,
                   (keys, passes.first_of, passes.rank, np.int64(n), inverse, uniq, first))
    return FixedUnique(uniq, inverse, first, passes.rank[n - 1:])


def unique_ids_fixed_find(passes: DedupPasses, table, rows=None, out=None,
                          launch: Launcher | None = None):
    """The output pass of ``dedup_passes_fixed`` with a hash index's find fused into it ->
    (``FixedUnique``, slots (n,) int64): ``unique_ids_fixed``'s arrays and, for each unique key,
    what ``DeviceHashIndex.find_live(fixed.keys, fixed.count, rows, out)`` returns (the slot,
    -1 where absent, ``NOT_LOOKED_UP`` (-2) from the count on), with the line of found key i
    copied into row i of ``out``, in one kernel (``hashindex_dedup_output_find``): each unique
    key is probed as it is written, never read back by a separate find.

    table: (capacity, 2) uint64, the index's buckets (``cache/device.py``'s layout, capacity a
    power of two); rows: (R, L) float32 behind the slots and out (n, L) float32, or both None
    (slots only). The caller holds the index still while the kernel runs (the tier chain's lock).
    """
    launch = resolve(launch)
    xp = launch.xp
    keys = passes.keys
    n = keys.shape[0]
    if n == 0:
        return FixedUnique(*_empty_unique(xp, True), xp.zeros(1, dtype=xp.int64)), \
            xp.empty(0, dtype=xp.int64)
    if rows is None:   # not read when line_size == 0; any float32 array stands in
        rows = out = xp.empty((1, 1), dtype=xp.float32)
        line_size = 0
    else:
        line_size = rows.shape[1]
    uniq, first, inverse = _fixed_outputs(xp, n)
    slots = xp.empty(n, dtype=xp.int64)
    vector = line_vector(np.float32, line_size, (rows, out))
    launch_warps(launch, "hashindex", "dedup_output_find", np.float32, -(-n // 32),
                 (keys, passes.first_of, passes.rank, np.int64(n), inverse, uniq, first, table,
                  np.int64(table.shape[0] - 1), rows, np.int32(line_size), vector, out, slots))
    return FixedUnique(uniq, inverse, first, passes.rank[n - 1:]), slots


def unique_ids_by_sorting(keys, launch: Launcher | None = None, return_first: bool = False):
    """``unique_ids`` as it was before the hash table, the baseline that ``benchmarks/bench_gpu.py``
    times beside it: same arguments, same results bit for bit.

    Sort-based: the keys are sorted (an argsort of all n keys), runs of equal keys found, each
    run's first batch position taken by an atomic minimum (so the sort need not be stable), and
    the runs are then numbered in order of their first positions (an argsort of the u firsts).
    """
    launch = resolve(launch)
    xp = launch.xp
    keys = device_array(launch, "keys", keys, np.uint64, ndim=1)
    n = keys.shape[0]
    if n == 0:
        return _empty_unique(xp, return_first)
    order = xp.argsort(keys).astype(xp.int64)                     # (n,) positions in key order
    sorted_keys = keys[order]
    head = xp.ones(n, dtype=xp.int64)
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    segment = xp.cumsum(head) - 1                                   # (n,) run of each sorted key
    n_unique = host_sync.scalar(segment[-1], "dedup: unique count") + 1
    first = xp.full(n_unique, n, dtype=xp.int64)                    # (u,) first position of a run
    launch_threads(launch, "embedding", "unique_first", np.float32, n, (order, segment, np.int64(n), first))
    by_first = xp.argsort(first)                                    # distinct values: one order
    new_id = xp.empty(n_unique, dtype=xp.int64)
    new_id[by_first] = xp.arange(n_unique, dtype=xp.int64)
    inverse = xp.empty(n, dtype=xp.int64)
    inverse[order] = new_id[segment]
    first = first[by_first]
    if return_first:
        return keys[first], inverse, first
    return keys[first], inverse


def segment_offsets(xp, sorted_ids, n_segments: int):
    """sorted_ids: (n,) int64 ascending, in [0, n_segments) -> (n_segments + 1,) int64: where
    each id's run starts (the last entry n), by a binary search per id, so nothing is read back
    (``bincount`` would be: CuPy's reads the ids' maximum and checks their sign on the host)."""
    bounds = xp.arange(int(n_segments) + 1, dtype=xp.int64)
    return xp.searchsorted(sorted_ids, bounds, side="left").astype(xp.int64)


def first_occurrence(inverse, n_unique: int, launch: Launcher | None = None):
    """inverse: (n,) int64 from ``unique_ids`` -> (n_unique,) int64 position of each unique key's
    first occurrence, as ``parallel.unique.first_occurrence``: (segment, position) packed into
    one distinct int64 per position, so any sort puts each segment's positions in order and the
    segments in id order (every id in 0..n_unique-1 occurs in an inverse)."""
    launch = resolve(launch)
    xp = launch.xp
    inverse = device_array(launch, "inverse", inverse, np.int64, ndim=1)
    n = inverse.shape[0]
    if n == 0 or int(n_unique) == 0:
        return xp.empty(0, dtype=xp.int64)
    order = xp.argsort(inverse * n + xp.arange(n, dtype=xp.int64)).astype(xp.int64)
    sorted_ids = inverse[order]
    head = xp.ones(n, dtype=xp.bool_)
    head[1:] = sorted_ids[1:] != sorted_ids[:-1]
    first = order[head]
    if first.shape[0] != int(n_unique):
        raise InputError(f"inverse holds {first.shape[0]} distinct ids, not n_unique={n_unique}")
    return first


def segment_order(xp, inverse, n_segments: int):
    """inverse: (n,) int64 in [0, n_segments) -> (rows_by_segment (n,) int64, the rows sorted by
    (segment, row); offsets (n_segments + 1,) int64, segment s owning
    rows_by_segment[offsets[s]:offsets[s + 1]]): the grouping the segment-sum kernels read."""
    if int(n_segments) > np.iinfo(np.int32).max:
        raise InputError(f"{n_segments} segments in one batch: at most 2**31 - 1 (the grouping "
                         "sorts segment ids as int32)")
    # a stable sort of the segment ids keeps each segment's rows in ascending order (CuPy's
    # argsort is stable), from a radix sort of 32-bit keys: before, (segment, row) packed into
    # one int64 per row took an (n,) key array and twice the key bits for the same order
    rows_by_segment = xp.argsort(inverse.astype(xp.int32), kind="stable").astype(
        xp.int64, copy=False)                          # argsort's own int64: no copy of it
    return rows_by_segment, segment_offsets(xp, inverse[rows_by_segment], n_segments)


#: The chunk of the segment sums' tree order (``oe::SUM_CHUNK`` of ``cuda/common.cuh``,
#: ``parallel.unique.SUM_CHUNK``): a segment of at most this many rows sums in row order.
SUM_CHUNK = 32


def tree_levels(n: int) -> int:
    """The levels of the tree order for a batch of ``n`` rows: 0 when no segment can exceed
    ``SUM_CHUNK`` rows, else how often ceil(m / SUM_CHUNK) must be applied to m = n to reach 1
    (the longest possible segment's levels; a shorter one's total is copied up the rest)."""
    n = int(n)
    if n <= SUM_CHUNK:
        return 0
    levels = 0
    while n > 1:
        n = -(-n // SUM_CHUNK)
        levels += 1
    return levels


def long_segment_totals(launch: Launcher, values, rows_by_segment, offsets, n_segments: int,
                        out, live=None) -> None:
    """The totals of the segments of more than ``SUM_CHUNK`` rows in the tree order, into
    their rows of out; nothing else of out is written, and nothing is read back to the host.

    values: (n, E) float32 / float64; rows_by_segment (n,) int64 and offsets (n_segments + 1,)
    int64 from ``segment_order``; out: (n_segments, E), values' dtype; live: None, or the (1,)
    int64 device count of a fixed-capacity batch (the segments from it on are neither read nor
    written). ``tree_levels(n)`` levels, each a counting kernel, a prefix sum and a level
    kernel with a thread per (value, column) (``cuda/embedding.cu``). The values of a level
    live in one of two scratch arrays sized by host-known bounds: level 1 has at most 2n // 33
    values (a segment of m > 32 rows has ceil(m / 32) <= 2m / 33); a later one at most level
    1's / 32 + n // 33 + 1 (one value more per long segment, at most n // 33 of them).
    """
    xp = launch.xp
    n, dim = values.shape
    n_segments = int(n_segments)
    levels = tree_levels(n)
    if levels == 0 or n_segments == 0 or dim == 0:
        return
    dtype = values.dtype
    if live is None:
        live = xp.full(1, n_segments, dtype=xp.int64)
    first_bound = 2 * n // 33
    later_bound = min(first_bound, first_bound // SUM_CHUNK + n // 33 + 1)
    scratch = [xp.empty((first_bound, dim), dtype=dtype), None]
    below_ends, below_values = offsets, values           # unread at level 1
    for level in range(1, levels + 1):
        counts = xp.empty(n_segments, dtype=xp.int64)
        launch_threads(launch, "embedding", "tree_counts", dtype, n_segments,
                       (offsets, live, np.int64(n_segments), np.int32(level), counts))
        ends = xp.cumsum(counts, dtype=xp.int64)
        last = level == levels
        if last:
            capacity, level_out = min(n_segments, n // 33), out
        else:
            slot = (level - 1) % 2
            if scratch[slot] is None:
                scratch[slot] = xp.empty((later_bound, dim), dtype=dtype)
            level_out = scratch[slot]
            capacity = level_out.shape[0]
        launch_threads(launch, "embedding", "tree_level", dtype, capacity * dim,
                       (values, np.int32(dim), rows_by_segment, offsets, np.int64(n_segments),
                        np.int32(level), below_ends, below_values, ends, np.int64(capacity),
                        np.int32(last), level_out))
        below_ends, below_values = ends, level_out


def segment_sum(values, inverse, n_segments: int, launch: Launcher | None = None,
                check_inverse: bool = True):
    """values: (n, E) float32, inverse: (n,) int64 in [0, n_segments) -> (n_segments, E).

    Each segment's rows are added in the tree order (``parallel.unique.segment_sum``): a segment of
    at most ``SUM_CHUNK`` rows in row order from +0, one thread per (segment, column); a longer one
    by ``long_segment_totals``' level kernels, a thread per (chunk, column). So the sums equal
    ``parallel.unique.segment_sum`` bit for bit (float32 subnormal sums flush to zero on the GPU).
    ``check_inverse=False`` skips the inverse's range check (a host read) for an inverse that
    ``unique_ids`` made.
    """
    launch = resolve(launch)
    xp = launch.xp
    values = device_array(launch, "values", values, None, ndim=2)
    dtype = _float_dtype("values", values)
    inverse = device_array(launch, "inverse", inverse, np.int64, ndim=1)
    n, dim = values.shape
    n_segments = int(n_segments)
    if inverse.shape[0] != n:
        raise InputError(f"inverse has {inverse.shape[0]} entries but values has {n} rows")
    if n == 0 or n_segments == 0 or dim == 0:
        return xp.zeros((n_segments, dim), dtype=dtype)
    if check_inverse and host_sync.flag((inverse.min() < 0) | (inverse.max() >= n_segments),
                      "segment_sum: inverse range check"):
        raise InputError(f"inverse holds values outside [0, {n_segments}): pass the inverse of "
                         "unique_ids and its number of unique keys")
    rows_by_segment, offsets = segment_order(xp, inverse, n_segments)
    out = xp.empty((n_segments, dim), dtype=dtype)       # every row written by one of the two
    launch_threads(launch, "embedding", "segment_sum", dtype, n_segments * dim,
                   (values, np.int32(dim), rows_by_segment, offsets, np.int64(n_segments), out))
    long_segment_totals(launch, values, rows_by_segment, offsets, n_segments, out)
    return out
