"""The write-log patch of ``EmbeddingShard.refresh``: the lines put (or erased) since a lookup,
oldest first, written into that lookup's rows, so that a prefetched read returns exactly what a
lookup made right before its rows are used would (``shard``'s docstring has the protocol).
"""
from __future__ import annotations

import numpy as np

from .kernels import device_ops, live_rows
from .step import OwnerRows
from .tiers import HashIndex


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


def patch_rows_on_device(xp, rows: OwnerRows, newer: list, launch=None):
    """``patch_rows`` on device arrays, without reading anything back: each row looks its key up
    by binary search in the put's (or erase's) sorted keys and takes the put's line by a select,
    so no compaction sizes a result (keys are unique within each). Returns the rows erased and
    not put again since (to initialise), or None.

    newer: (keys, lines or None, live or None) per put. A fixed-capacity put's keys from its
    ``live`` count on are placeholders (key 0, maybe repeated, maybe a real key too): the
    stable sort keeps a real key ahead of them and a match counts only below ``live``; the
    rows' own placeholders (from ``rows.live`` on) are never patched, nor read: a put's lines
    go in by ``live_rows.patch_rows`` (needs ``launch``)."""
    v = rows.keys.shape[0]
    if v == 0:
        return None
    erased = None
    valid_rows = None if rows.live is None else xp.arange(v, dtype=xp.int64) < rows.live
    for put_keys, put_lines, put_live in newer:
        put_keys = xp.asarray(put_keys)
        m = put_keys.shape[0]
        if m == 0:
            continue
        order = xp.argsort(put_keys, kind="stable")
        sorted_keys = put_keys[order]
        pos = xp.minimum(xp.searchsorted(sorted_keys, rows.keys), m - 1)
        hit = sorted_keys[pos] == rows.keys                        # (v,) row's key was put
        if put_live is not None:
            hit &= order[pos] < put_live
        if valid_rows is not None:
            hit &= valid_rows
        if put_lines is None:                                      # an erase
            erased = hit.copy() if erased is None else erased | hit
            rows.found[...] = rows.found & ~hit
            continue
        if valid_rows is None:
            rows.lines[...] = xp.where(hit[:, None], xp.asarray(put_lines)[order[pos]],
                                       rows.lines)
        else:
            live_rows.patch_rows(rows.lines, xp.where(hit, order[pos], -1), put_lines, rows.live,
                                 launch)
        rows.found[...] = rows.found | hit
        if erased is not None:
            erased = erased & ~hit
    return erased


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
