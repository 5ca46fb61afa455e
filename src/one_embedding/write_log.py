"""The write-log patch of ``EmbeddingShard.refresh``: the lines put (or erased) since a lookup,
oldest first, written into that lookup's rows, so that a prefetched read returns exactly what a
lookup made right before its rows are used would (``shard``'s docstring has the protocol).
"""
from __future__ import annotations

import functools

import numpy as np

from .kernels import device_ops, hash_find, live_rows
from .step import OwnerRows
from .tiers import HashIndex
from .tiers.hash_index import EMPTY, _capacity_for


def patch_rows(rows: OwnerRows, newer: list):
    """The write-log patch of ``refresh``: each put's lines (oldest first) into the rows of the
    same keys; an erase (lines None) marks its keys not found. Returns (v,) bool: the rows
    erased and not put again since (to initialise), or None."""
    index = HashIndex(rows.keys.shape[0])
    index.assign(rows.keys, np.arange(rows.keys.shape[0], dtype=np.int64))
    erased = None
    for put_keys, put_lines in newer:
        slots = index.find(put_keys)
        hit = slots >= 0
        erased = _apply_put(np, rows, slots[hit], put_lines, hit, erased)
    return erased


#: the device patch finds a lookup's keys in each put through a hash index of the put's keys
#: (``kernels/cuda/hashindex.cu``: one insert and one find kernel, the find copying the put's
#: lines into the rows it matches); False: by a stable sort of the put's keys and a binary search
#: (CuPy's argsort, searchsorted and some ten array operations a put), the path before, kept as
#: the baseline ``bench_gpu`` times it against. The same rows, lines and flags either way
HASHED_PATCH = True


def patch_rows_on_device(xp, rows: OwnerRows, newer: list, launch=None):
    """``patch_rows`` on device arrays, without reading anything back. Returns the rows erased
    and not put again since (to initialise), or None.

    newer: (keys, lines or None, live or None) per put, oldest first; keys are unique below a
    put's count. A fixed-capacity put's keys from its ``live`` count on are placeholders (key
    0, maybe repeated, maybe a real key too) and never match; the rows' own placeholders (from
    ``rows.live`` on) are never patched, nor read. ``HASHED_PATCH`` picks how a row finds its
    key in a put (see there); ``launch`` runs the kernels (the hashed path and the rows of a
    fixed-capacity lookup need it)."""
    if rows.keys.shape[0] == 0:
        return None
    patch = _patch_put_sorted
    if HASHED_PATCH:
        launch = device_ops.resolve(launch)
        keys = device_ops.device_array(launch, "row keys", rows.keys, np.uint64, ndim=1)
        patch = functools.partial(_patch_put_hashed, keys=keys)      # converted once, not a put
    erased = None
    for put_keys, put_lines, put_live in newer:
        if put_keys.shape[0] == 0:
            continue
        hit = patch(xp, rows, xp.asarray(put_keys), put_lines, put_live, launch)   # (v,) bool
        if put_lines is None:                                      # an erase
            erased = hit.copy() if erased is None else erased | hit
            rows.found[...] = rows.found & ~hit
            continue
        rows.found[...] = rows.found | hit
        if erased is not None:
            erased = erased & ~hit
    return erased


def _patch_put_hashed(xp, rows: OwnerRows, put_keys, put_lines, put_live, launch, keys):
    """One put (or erase: ``put_lines`` None) into ``rows``: the put's keys go into a hash
    index by position (``hashindex_insert_positions``, those below ``put_live`` only), and one
    warp per row probes it for the row's key and copies the put's line over the row's line
    where found (``hashindex_find`` / ``hashindex_find_live`` below ``rows.live``). Returns
    (v,) bool: the rows whose key the put holds. keys: rows.keys as (v,) uint64 on the device."""
    m, v = put_keys.shape[0], keys.shape[0]
    put_keys = device_ops.device_array(launch, "put keys", put_keys, np.uint64, ndim=1)
    # empty buckets: every word EMPTY (-1 as int64), the slot word's all-ones in hashindex.cu
    table = xp.full((_capacity_for(m), 2), EMPTY, dtype=xp.int64).view(xp.uint64)
    has_live = put_live is not None
    live = put_live if has_live else xp.empty(1, dtype=xp.int64)   # not read without a count
    device_ops.launch_threads(launch, "hashindex", "insert_positions", np.float32, m,
                              (table, np.int64(table.shape[0] - 1), put_keys, np.int64(m), live,
                               np.int32(has_live)))
    lines = out = None                                             # an erase: no lines
    if put_lines is not None:
        out = device_ops.device_array(launch, "rows' lines", rows.lines, rows.lines.dtype,
                                      ndim=2, writable=True)
        lines = device_ops.device_array(launch, "put lines", put_lines, out.dtype, ndim=2)
    if rows.live is None:             # row i's line lands in out[i] (out_rows unread without)
        out_rows = xp.arange(v, dtype=xp.int64) if lines is not None else None
        slots, _ = hash_find.find(launch, table, keys, lines, out, out_rows)
    else:                                          # NOT_LOOKED_UP (-2) from rows.live on
        slots = hash_find.find_live(launch, table, keys, rows.live, lines, out)
    return slots >= 0


def _patch_put_sorted(xp, rows: OwnerRows, put_keys, put_lines, put_live, launch):
    """``_patch_put_hashed`` by sorting instead: each row looks its key up by binary search in
    the put's stably sorted keys (a real key sorts ahead of equal placeholders, and a match
    counts only below ``put_live``) and takes the put's line by a select (rows of a
    fixed-capacity lookup by ``live_rows.patch_rows``, needs ``launch``)."""
    v, m = rows.keys.shape[0], put_keys.shape[0]
    order = xp.argsort(put_keys, kind="stable")
    sorted_keys = put_keys[order]
    pos = xp.minimum(xp.searchsorted(sorted_keys, rows.keys), m - 1)
    hit = sorted_keys[pos] == rows.keys                            # (v,) row's key was put
    if put_live is not None:
        hit &= order[pos] < put_live
    if rows.live is not None:
        hit &= xp.arange(v, dtype=xp.int64) < rows.live
    if put_lines is None:
        return hit
    if rows.live is None:
        rows.lines[...] = xp.where(hit[:, None], xp.asarray(put_lines)[order[pos]], rows.lines)
    else:
        live_rows.patch_rows(rows.lines, xp.where(hit, order[pos], -1), put_lines, rows.live,
                             launch)
    return hit


def _apply_put(xp, rows: OwnerRows, slots, put_lines, hit, erased):
    """One logged put (or erase, ``put_lines`` None) into ``rows`` at ``slots`` (its keys
    ``hit`` among the put's); returns the rows erased so far and not put again (or None)."""
    if put_lines is None:
        erased = xp.zeros(rows.keys.shape[0], dtype=xp.bool_) if erased is None else erased
        erased[slots] = True
        rows.found[slots] = False
        return erased
    rows.lines[slots] = put_lines[hit]
    rows.found[slots] = True
    if erased is not None:
        erased[slots] = False
    return erased


class RetiredEntries:
    """Log entries the shard has let go of, kept referenced until the device has run every read
    of them that was queued (on a GPU; nothing to keep on the CPU).

    A logged put's arrays may have been allocated on another CUDA stream (a fixed-capacity put
    logs the prefetch thread's unique keys and count as they are): dropped while the consumer's
    stream still has a ``refresh`` patch queued that reads them, CuPy's pool would hand their
    memory back to that other stream, whose next batch could overwrite it before the patch ran.
    ``read`` records an event after each batch of queued reads (on the reading stream); ``retire``
    holds what is dropped until the last such event has passed (``device_ops.HeldUntil``).
    """

    def __init__(self, launch):
        self._launch = launch
        self._last_read = None
        self._held = None if launch is None else device_ops.HeldUntil(launch)

    def read(self) -> None:
        """After queueing reads of log entries on the current stream."""
        if self._launch is not None:
            self._last_read = self._launch.record()

    def retire(self, entries) -> None:
        """``entries`` (a list) are dropped from the log: keep them until the last read ran."""
        if self._launch is None or not entries:
            return
        if self._last_read is not None and not self._launch.done(self._last_read):
            self._held.hold(list(entries), self._last_read)
        self._held.collect()

    def collect(self) -> None:
        if self._held is not None:
            self._held.collect()

    def __len__(self) -> int:
        return 0 if self._held is None else len(self._held)
