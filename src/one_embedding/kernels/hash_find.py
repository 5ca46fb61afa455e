"""The finds of a device hash index (``cuda/hashindex.cu``), launched for its two users: the
cache's index (``cache.device_index.DeviceHashIndex``) and the write log's patch through an
index of a put's keys (``write_log``).

table: (capacity, 2) uint64 buckets ``[key, slot]`` (capacity a power of two, empty buckets all
ones), mask = capacity - 1. A warp probes for each key from ``mix64(key) & mask`` and, where the
key is found and lines are given, copies the line of the key's slot from ``rows`` into ``out``
(16 bytes per lane where ``device_ops.line_vector`` allows). Without lines nothing is copied:
the row arguments are not read and a one-element stand-in goes in their place.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .device_ops import Launcher, line_vector, launch_warps


def _lines(xp, rows, out):
    """(rows, out, line_size, dtype) as the kernels take them: stand-ins of float32 and
    line_size 0 without ``rows``; else rows' dtype, the lines' widths checked."""
    if rows is None:
        stand_in = xp.empty((1, 1), dtype=xp.float32)
        return stand_in, stand_in, 0, np.dtype(np.float32)
    line_size = rows.shape[1]
    if out.shape[1] != line_size:
        raise InputError(f"lines of {line_size} values do not fit rows of {out.shape[1]} in out: "
                         "pass an out of the rows' width")
    return rows, out, line_size, np.dtype(rows.dtype)


def find(launch: Launcher, table, keys, rows=None, out=None, out_rows=None):
    """keys: (n,) uint64 -> (slots (n,) int64, buckets (n,) int64), -1 where absent. With
    ``rows`` (R, L) and ``out`` (N, L) of one float dtype and ``out_rows`` (n,) int64, the line
    ``rows[slot]`` of every found key i is copied into ``out[out_rows[i]]``
    (``hashindex_find``). ``out_rows`` is not read without rows."""
    xp = launch.xp
    n = keys.shape[0]
    slots = xp.empty(n, dtype=xp.int64)
    buckets = xp.empty(n, dtype=xp.int64)
    rows, out, line_size, dtype = _lines(xp, rows, out)
    if not line_size:
        out_rows = slots
    vector = line_vector(dtype, line_size, (rows, out))
    launch_warps(launch, "hashindex", "find", dtype, n,
                 (table, np.int64(table.shape[0] - 1), keys, np.int64(n), rows,
                  np.int32(line_size), vector, out_rows, out, slots, buckets))
    return slots, buckets


def find_live(launch: Launcher, table, keys, live, rows=None, out=None):
    """``find`` of the first ``live`` keys of a fixed-capacity batch, live a (1,) int64 device
    count (read by the kernel, not the host). With ``rows`` (R, L) and ``out`` (n, L) of one
    float dtype, the line of found key i is copied into ``out[i]`` (``hashindex_find_live``).
    -> slots (n,) int64: the slot, -1 where absent, -2 (``NOT_LOOKED_UP``) from live on."""
    xp = launch.xp
    n = keys.shape[0]
    slots = xp.empty(n, dtype=xp.int64)
    rows, out, line_size, dtype = _lines(xp, rows, out)
    vector = line_vector(dtype, line_size, (rows, out))
    launch_warps(launch, "hashindex", "find_live", dtype, n,
                 (table, np.int64(table.shape[0] - 1), keys, np.int64(n), live, rows,
                  np.int32(line_size), vector, out, slots))
    return slots
