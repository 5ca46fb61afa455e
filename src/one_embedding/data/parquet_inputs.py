"""Criteo files as other tools leave them: which paths are data, and how a third-party Parquet
file's categorical ids become keys.

**Paths.** A folder stands for the files in it, and a pattern (``parts/*.parquet``, quoted so
the shell left it alone, or from a config file) for the files it matches, both sorted. Names
that start with ``_`` or ``.`` are skipped in a folder, a pattern or a list of several paths: the
convention of Hadoop, Spark, Dask and pyarrow's datasets for what is not data (``_SUCCESS``,
``_metadata``, ``_common_metadata``, ``.part-0.crc``); a single path is always taken as given.

**Keys.** The embedding has one key space for all tables (OneEmbedding's), so the 26 columns'
ids must not share values unless the rows are meant to be shared. Our files and OneFlow's make
them unique (``schema.KeyScheme``; OneFlow's tools add ``column * (mod + 1)`` or hash with the
column as seed). Other tools (NVTabular's Categorify, HugeCTR's Parquet, pandas category codes)
number each column's values from 0, unique only within the column. ``keys``:

* ``"global"``: the ids are keys as stored;
* ``"per_column"``: key = id + column * 2**32 (C1 is column 0), the TSV key scheme's ranges;
  ids must lie in [0, 2**32);
* ``None`` (auto): global for a file with our metadata (either layout); for any other file,
  decided from the footer's column statistics: where every C column has them, all lie in
  [0, 2**32) and two columns' [min, max] ranges overlap, the ids look per-column and the file is
  refused, naming both choices (read as stored, equal ids of two columns would train one row);
  otherwise global.
"""
from __future__ import annotations

import glob
import os

import numpy as np

from ..errors import ConfigError, InputError
from .schema import SPARSE_COLUMNS

KEY_MODES = ("global", "per_column")
#: per-column ids: key = id + column << PER_COLUMN_SHIFT
PER_COLUMN_SHIFT = 32
_GLOB_CHARS = set("*?[")


def _is_data_name(path: str) -> bool:
    return not os.path.basename(path).startswith(("_", "."))


def expand_paths(paths: list) -> list[str]:
    """Input paths -> the data files they stand for (module docstring), in the order given, a
    folder's or a pattern's files sorted. InputError for a pattern that matches nothing, a
    folder with sub-folders (a partitioned dataset: pass its files) or without data files."""
    several = len(paths) > 1
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            entries = sorted(os.path.join(p, e) for e in os.listdir(p) if _is_data_name(e))
            folders = [e for e in entries if os.path.isdir(e)]
            if folders:
                raise InputError(f"{p} holds folders ({', '.join(folders[:3])}): a partitioned "
                                 f"dataset is not read whole; pass its files (e.g. {p}/*/*)")
            if not entries:
                raise InputError(f"{p} is a folder with no data files (names starting with '_' "
                                 f"or '.' are markers and summaries, not data)")
            out.extend(entries)
        elif not os.path.exists(p) and _GLOB_CHARS & set(p):
            matches = sorted(m for m in glob.glob(p) if _is_data_name(m)
                             and not os.path.isdir(m))
            if not matches:
                raise InputError(f"{p}: the pattern matches no data file; check the path")
            out.extend(matches)
        elif not several or _is_data_name(p):
            out.append(p)
    if not out:
        raise InputError(f"{[os.fspath(p) for p in paths]}: only markers and summaries (names "
                         "starting with '_' or '.'), no data files")
    return out


def check_keys(keys) -> str | None:
    if keys is not None and keys not in KEY_MODES:
        raise ConfigError(f"keys={keys!r}: use 'global' (the ids are keys as stored), "
                          f"'per_column' (ids unique within their column: key = id + "
                          f"column * 2**32), or None to decide from the file")
    return keys


def _column_ranges(metadata) -> list[tuple[int, int]] | None:
    """[(min, max)] of C1..C26 over every row group from the footer's statistics; None where
    one is missing (the decision then cannot be made from the footer)."""
    names = [metadata.schema.column(i).name for i in range(metadata.num_columns)]
    index = {name: i for i, name in enumerate(names)}
    ranges = []
    for name in SPARSE_COLUMNS:
        lo = hi = None
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            if group.num_rows == 0:
                continue
            stats = group.column(index[name]).statistics
            if stats is None or not stats.has_min_max:
                return None
            try:
                g_lo, g_hi = int(stats.min), int(stats.max)
            except (TypeError, ValueError):   # dictionary or other non-integer statistics
                return None
            lo = g_lo if lo is None else min(lo, g_lo)
            hi = g_hi if hi is None else max(hi, g_hi)
        if lo is None:
            return None
        ranges.append((lo, hi))
    return ranges


def decide_keys(path: str, keys: str | None, ours: bool, metadata) -> str:
    """The key mode of one file: ``keys`` when given; else global for a file with our metadata
    (``ours``), and for any other from its footer ``metadata`` (pyarrow FileMetaData) as the
    module docstring says. InputError naming two overlapping columns where the ids look
    per-column."""
    if keys is not None or ours:
        return keys or "global"
    ranges = _column_ranges(metadata)
    if ranges is None or any(lo < 0 or hi >= 1 << PER_COLUMN_SHIFT for lo, hi in ranges):
        return "global"
    order = sorted(range(len(ranges)), key=lambda j: ranges[j])
    for a, b in zip(order, order[1:]):
        if ranges[b][0] <= ranges[a][1]:
            a, b = sorted((a, b))
            raise InputError(
                f"{path}: C{a + 1} holds ids {ranges[a][0]}..{ranges[a][1]} and C{b + 1} "
                f"{ranges[b][0]}..{ranges[b][1]}: ids numbered within each column (as "
                f"NVTabular's Categorify or HugeCTR write them) would share embedding rows "
                f"across columns, since all tables share one key space. Pass "
                f"keys='per_column' (--parquet-keys per_column: key = id + column * 2**32), or "
                f"keys='global' (--parquet-keys global) if the columns are meant to share ids")
    return "global"


def key_column(ids: np.ndarray, column: int, mode: str, first_row: int, where: str) -> np.ndarray:
    """One C column's ids (N,) int64 -> its keys (N,) int64 under ``mode`` (per_column: InputError
    naming the row of an id outside [0, 2**32))."""
    if mode == "global":
        return ids
    outside = (ids < 0) | (ids >= 1 << PER_COLUMN_SHIFT)
    if outside.any():
        at = int(np.argmax(outside))
        raise InputError(f"{where}row {first_row + at}: {SPARSE_COLUMNS[column]} = {ids[at]} is "
                         f"outside [0, 2**32), which per-column ids must be in; read the file "
                         f"with keys='global' (--parquet-keys global) if its ids are keys")
    return ids + np.int64(column << PER_COLUMN_SHIFT)


def check_oneflow_dense(raw_plus_one: np.ndarray, first_row: int, where: str) -> None:
    """OneFlow's dense columns hold raw + 1 of Criteo's integers: InputError naming the first
    value that is not an integer (a file whose dense values were transformed already, e.g. by
    NVTabular's LogOp / Normalize, or ours with its metadata dropped, read as OneFlow's would
    take the log of them). raw_plus_one: (N, 13) float64."""
    bad = raw_plus_one != np.floor(raw_plus_one)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise InputError(f"{where}row {first_row + row}: I{col + 1} = {float(raw_plus_one[row, col])!r} "
                         f"is not an integer, so this is not OneFlow's layout (raw + 1, the log "
                         f"taken when read), which a file without this library's metadata is "
                         f"taken to be; if its dense values are transformed already (log, "
                         f"normalized), read them as stored: layout='one_embedding' "
                         f"(--parquet-layout one_embedding)")
