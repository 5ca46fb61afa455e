"""Row kernels of a fixed-capacity batch (``device_unique.unique_ids_fixed``): arrays of n rows
whose first ``live`` are real, ``live`` a (1,) int64 count that stays on the device. Each
launch covers the n rows, and its threads past the count return at once without reading or
writing, so the placeholder rows cost idle threads, not memory traffic (a CuPy expression over
the whole array would read and write all n rows: 4.3x the live ones at 1.70 M ids for 393 k
unique keys). Kernels: ``cuda/embedding.cu`` (``embedding_fill_missing``, a thread per
element; ``embedding_patch_rows``, a warp per row, 16 bytes per lane where
``device_ops.line_vector`` allows). The update's finite-rows check is the update kernel's own
(``device_ops.run_update``).
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .device_ops import Launcher, device_array, launch_threads, launch_warps, line_vector, resolve


def _lines_and_live(launch, lines, live):
    lines = device_array(launch, "lines", lines, np.float32, ndim=2, writable=True)
    live = device_array(launch, "live", live, np.int64, ndim=1)
    if live.shape != (1,):
        raise InputError(f"live has shape {tuple(live.shape)}: pass the (1,) count")
    return lines, live


def fill_missing(lines, found, live, blocks, launch: Launcher | None = None) -> None:
    """In place: ``lines[i, start:start + width] = value`` for each (start, width, value) of
    ``blocks`` in every row i below ``live`` whose ``found[i]`` is False (a new key's optimizer
    state before its first update); no other row is touched. lines: (n, L) float32, C-contiguous;
    found: (n,) bool; live: (1,) int64 device count. ``value`` is rounded to float32 once, as
    numpy's assignment does."""
    launch = resolve(launch)
    lines, live = _lines_and_live(launch, lines, live)
    n, line_size = lines.shape
    found = device_array(launch, "found", found, np.bool_, ndim=1).view(launch.xp.uint8)
    if found.shape[0] != n:
        raise InputError(f"found has {found.shape[0]} rows, lines {n}")
    for start, width, value in blocks:
        if not 0 <= start <= start + width <= line_size:
            raise InputError(f"columns [{start}, {start + width}) are outside lines of {line_size}")
        launch_threads(launch, "embedding", "fill_missing", np.float32, n * int(width),
                       (lines, np.int32(line_size), found, np.int64(n), live, np.int32(start),
                        np.int32(width), np.float64(np.float32(value))))


def patch_rows(lines, source, put_lines, live, launch: Launcher | None = None) -> None:
    """In place: ``lines[i] = put_lines[source[i]]`` for every row i below ``live`` with
    ``source[i] >= 0``; no other row is touched. lines: (n, L) float32; source: (n,) int64;
    put_lines: (m, L) float32; live: (1,) int64 device count."""
    launch = resolve(launch)
    lines, live = _lines_and_live(launch, lines, live)
    n, line_size = lines.shape
    source = device_array(launch, "source", source, np.int64, ndim=1)
    put_lines = device_array(launch, "put_lines", put_lines, np.float32, ndim=2)
    if source.shape[0] != n or put_lines.shape[1] != line_size:
        raise InputError(f"source {tuple(source.shape)} / put_lines {tuple(put_lines.shape)} do "
                         f"not fit lines {tuple(lines.shape)}")
    launch_warps(launch, "embedding", "patch_rows", np.float32, n if line_size else 0,
                 (lines, np.int32(line_size), source, put_lines, np.int64(n), live,
                  line_vector(np.float32, line_size, (lines, put_lines))))
