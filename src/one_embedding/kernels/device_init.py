"""The initial values of new rows on the device: the twins of ``initializers.fill_initial_values``
(``fill_initial_values``, one (table, column range) at a time) and the per-table launch of a
lookup's missing rows (``init_spec`` once per embedding, then ``init_missing`` per lookup), the
kernels of ``cuda/embedding.cu``. Every function takes ``launch``, a ``device_ops.Launcher``
(CuPy, or the host emulator in the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import host_sync
from ..errors import InputError
from ..options import ConstantInitializer, NormalInitializer, TruncNormalInitializer, UniformInitializer
from .device_ops import MASK64, Launcher, device_array, launch_threads, resolve


def initializer_code(init) -> tuple[int, tuple[float, float, float, float]]:
    """(kind, (p0, p1, p2, p3)) of an initializer, as ``initializers.fill_initial_values`` passes
    them to its kernel: 0 constant, 1 uniform, 2 normal, 3 truncated normal."""
    if isinstance(init, ConstantInitializer):
        return 0, (float(init.value), 0.0, 0.0, 0.0)
    if isinstance(init, UniformInitializer):
        return 1, (float(init.low), float(init.high), 0.0, 0.0)
    if isinstance(init, NormalInitializer):
        return 2, (float(init.mean), float(init.std), 0.0, 0.0)
    if isinstance(init, TruncNormalInitializer):
        return 3, (float(init.mean), float(init.std), float(init.a), float(init.b))
    raise TypeError(f"unknown initializer {init!r}")


def fill_initial_values(lines, rows, keys, init, seed: int, col_start: int, n_cols: int,
                        out_offset: int, launch: Launcher | None = None,
                        check_rows: bool = True) -> None:
    """``lines[rows, out_offset:out_offset + n_cols]`` = initial values of ``keys`` at columns
    ``col_start..col_start + n_cols - 1``, in place. lines: (N, L) float32 (C-contiguous);
    rows: (m,) int64; keys: (m,) uint64.

    The device twin of ``initializers.fill_initial_values``: the same counter hash (exact), the
    same float64 transforms rounded once to float32. ``check_rows=False`` skips the rows' range
    check (a host read) for callers whose rows index ``lines`` by construction. CUDA's log1p / cos may differ from the host
    libm in the last float64 ulp, which moves a float32 result by at most 1 ulp, rarely.
    """
    launch = resolve(launch)
    lines = device_array(launch, "lines", lines, np.float32, ndim=2, writable=True)
    rows = device_array(launch, "rows", rows, np.int64, ndim=1)
    keys = device_array(launch, "keys", keys, np.uint64, ndim=1)
    if rows.shape != keys.shape:
        raise InputError(f"rows {tuple(rows.shape)} and keys {tuple(keys.shape)} must match")
    if out_offset < 0 or n_cols < 0 or out_offset + n_cols > lines.shape[1]:
        raise InputError(f"columns [{out_offset}, {out_offset + n_cols}) lie outside lines of "
                         f"width {lines.shape[1]}")
    if check_rows and rows.shape[0] and host_sync.flag(
            (rows.min() < 0) | (rows.max() >= lines.shape[0]), "fill_initial_values: row range check"):
        raise InputError(f"rows must lie in [0, {lines.shape[0]}), the rows of lines")
    kind, params = initializer_code(init)
    launch_threads(launch, "embedding", "init", np.float32, keys.shape[0] * int(n_cols),
                   (lines, np.int32(lines.shape[1]), rows, keys, np.int64(keys.shape[0]),
                    np.int64(col_start), np.int32(n_cols), np.int32(out_offset),
                    np.uint64(int(seed) & MASK64), np.int32(kind), *(np.float64(p) for p in params)))


@dataclass(frozen=True)
class InitSpec:
    """Every table's initializers for ``init_missing``, on the device: col_of (width,) int32,
    the column holding each embedding element; kinds (n_tables * n_columns,) int32 and params
    (n_tables * n_columns * 4,) float64, table-major (``initializer_code``)."""
    width: int
    n_columns: int
    col_of: object
    kinds: object
    params: object


def init_spec(columns, initializers, launch: Launcher | None = None) -> InitSpec:
    """columns: [(offset, dim), ...] covering the embedding elements [0, width) in order;
    initializers: per table, one initializer per column -> the ``InitSpec`` of them."""
    launch = resolve(launch)
    width = sum(dim for _, dim in columns)
    col_of = np.empty(width, np.int32)
    for c, (offset, dim) in enumerate(columns):
        col_of[offset:offset + dim] = c
    codes = [initializer_code(init) for table in initializers for init in table]
    kinds = np.array([kind for kind, _ in codes], np.int32)
    params = np.array([p for _, ps in codes for p in ps], np.float64)
    return InitSpec(width, len(columns), *(launch.to_device(a) for a in (col_of, kinds, params)))


def init_missing(lines, missing, table_ids, keys, spec: InitSpec, seed: int,
                 launch: Launcher | None = None) -> None:
    """The lines of the rows where ``missing`` is True, in place, in one launch and without a
    read: the initial values of each row's key with its table's initializers in the embedding
    columns, 0 in the state columns; the other rows keep their bits. lines: (n, L) float32;
    missing: (n,) bool; table_ids: (n,) int32; keys: (n,) uint64. Equals ``fill_initial_values``
    of each table's missing rows (and zeroed states), element for element."""
    launch = resolve(launch)
    xp = launch.xp
    lines = device_array(launch, "lines", lines, np.float32, ndim=2, writable=True)
    n = lines.shape[0]
    missing = device_array(launch, "missing", missing, np.bool_, ndim=1).view(xp.uint8)
    table_ids = device_array(launch, "table_ids", table_ids, np.int32, ndim=1)
    keys = device_array(launch, "keys", keys, np.uint64, ndim=1)
    if not (missing.shape[0] == table_ids.shape[0] == keys.shape[0] == n):
        raise InputError(f"missing {tuple(missing.shape)}, table_ids {tuple(table_ids.shape)} and "
                         f"keys {tuple(keys.shape)} must all have the {n} rows of lines")
    if spec.width > lines.shape[1]:
        raise InputError(f"the initializers cover {spec.width} columns; lines have {lines.shape[1]}")
    launch_threads(launch, "embedding", "init_missing", np.float32, n * lines.shape[1],
                   (lines, np.int32(lines.shape[1]), missing, table_ids, keys, np.int64(n),
                    np.int32(spec.width), spec.col_of, np.int32(spec.n_columns), spec.kinds,
                    spec.params, np.uint64(int(seed) & MASK64)))
