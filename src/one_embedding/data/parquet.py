"""Criteo in Parquet: OneFlow's files, our own, and the streaming TSV -> Parquet converter.

Two layouts are read. They differ in the dense columns, so telling them apart decides whether the
reader takes the log (OneFlow's) or not (ours) -- exactly once either way:

* **ours**, ``"one_embedding"`` (metadata key ``one_embedding.criteo`` holds JSON
  ``{"version": 1, "dense": "log1p", "key_scheme": {...}, "has_label": ...}``): ``label`` float32
  (NaN when the source had no label), ``I1..I13`` float32 already ``log(max(x, 0) + 1)`` with
  missing -> 0, ``C1..C26`` int64 global keys (``schema.KeyScheme``). Dense values come out as
  stored.
* **OneFlow's**, ``"oneflow"`` (no ``one_embedding.criteo`` key): ``label`` float or integer,
  ``I1..I13`` holding ``raw + 1`` with missing -> 1 (float, or int32 as OneFlow's Python tool
  writes them; the ``log`` is OneFlow's training-time step), ``C1..C26`` int64 keys hashed per
  column by whatever tool wrote them. Batches get ``dense = log1p(max(I - 1, 0))`` computed in
  float64, so a row reads bit-identically to the same row in our layout (exact while
  ``raw + 1`` is exact in the file's type: always for float64/int32, below 2**24 for float32).
  ``convert_tsv_to_parquet(..., layout="oneflow")`` writes this layout too: ``raw + 1`` as int32
  (as OneFlow's Python tool writes it; exact, where its Scala tool's float32 rounds above 2**24),
  negative raw values kept as OneFlow's tools keep them, keys from the ``key_scheme``, and a provenance key ``one_embedding.criteo_source`` (``{"layout": "oneflow",
  ...}``) that only documents the file -- a reader that knows nothing of it still reads the
  file as OneFlow's, which it is.

The layout is detected per file from that metadata; ``ParquetReader(..., layout=...)`` names it
instead (for a file of ours whose metadata a rewrite dropped), but never against the file's own
metadata: that conflict, the one that would take the log twice or not at all, is an InputError.
A file read as OneFlow's must hold integers in I1..I13 (raw + 1): a non-integer value (a file
whose dense values another tool transformed already) is refused, naming the override. Files
that other tools wrote, with ids numbered within each column, and the paths such tools leave
(folders, ``_SUCCESS``, ``_metadata``): ``parquet_inputs``.

A file is Parquet by its content (``PAR1`` magic), never by its name. Bad files fail with an
``InputError`` naming the file, and the column where one is to blame: a missing column or one of
the wrong type (a string label, say) when the reader is built, nulls or a damaged page when the
row group is read. Our writers store page checksums and the reader verifies them, so a flipped byte
in our files is caught even where it would still decode.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, InputError
from .parquet_inputs import check_keys, check_oneflow_dense, decide_keys, key_column
from .schema import (DENSE_COLUMNS, LABEL_COLUMN, NUM_DENSE, NUM_SPARSE, SPARSE_COLUMNS,
                     KeyScheme)
from .tsv import FILE_SHIFT, Chunk, CriteoTSVReader, default_max_hex_digits, refuse_compressed

METADATA_KEY = b"one_embedding.criteo"
#: provenance of a OneFlow-layout file written by ``convert_tsv_to_parquet(layout="oneflow")``;
#: deliberately not METADATA_KEY, so every reader treats the file as OneFlow's (dense = raw + 1)
SOURCE_KEY = b"one_embedding.criteo_source"
FORMAT_VERSION = 1
#: the two Criteo layouts: ours (dense already log1p) and OneFlow's (dense = raw + 1)
LAYOUTS = ("one_embedding", "oneflow")
PARQUET_MAGIC = b"PAR1"
COLUMNS = (LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS)
_ARROW_ERRORS = (OSError, pa.ArrowException)  # what pyarrow raises for unreadable bytes


def is_parquet_file(path) -> bool:
    """True when ``path`` starts with Parquet's magic bytes, whatever its name.

    InputError for a path that is missing or a folder (neither a Parquet nor a TSV file), and
    for a compressed file (Criteo 1TB ships ``day_N.gz``: read as TSV, its bytes were one bad
    line, and the advice to skip bad lines would have dropped them all)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(f"{path} is a folder: pass the files in it (e.g. {path}/*)")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(b"\x93NUMPY"):
            raise InputError(f"{path} is a NumPy .npy file (TorchRec's preprocessed Criteo?), "
                             f"which is not read: pass Criteo's TSV files or Parquet files")
        refuse_compressed(path)
        return head[:len(PARQUET_MAGIC)] == PARQUET_MAGIC
    except FileNotFoundError:
        raise InputError(f"{path}: no such TSV file or Parquet file; check the path") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e})") from e


def _paths(path_or_paths) -> list[str]:
    if isinstance(path_or_paths, (str, os.PathLike)):
        return [os.fspath(path_or_paths)]
    paths = [os.fspath(p) for p in path_or_paths]
    if not paths:
        raise ConfigError("no input files: pass a path or a non-empty list of paths")
    return paths


def parquet_schema(layout: str = "one_embedding") -> pa.Schema:
    """The schema our writers use (without metadata): label float32, I1..I13 float32 (ours) or
    int32 (``layout="oneflow"``: raw + 1), C1..C26 int64."""
    dense_type = pa.int32() if layout == "oneflow" else pa.float32()
    fields = [pa.field(LABEL_COLUMN, pa.float32())]
    fields += [pa.field(name, dense_type) for name in DENSE_COLUMNS]
    fields += [pa.field(name, pa.int64()) for name in SPARSE_COLUMNS]
    return pa.schema(fields)


def _check_layout(layout) -> str | None:
    if layout is not None and layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r}: use 'one_embedding' (dense already log(x+1)), "
                          f"'oneflow' (dense = raw + 1, the log taken when read), or None to "
                          f"detect it from the file's metadata")
    return layout


def _metadata_layout(path: str, metadata: dict) -> str | None:
    """The layout the file's own metadata states, or None (no metadata of ours)."""
    if METADATA_KEY in metadata:
        try:
            info = json.loads(metadata[METADATA_KEY])
        except ValueError as e:
            raise InputError(f"{path}: damaged one_embedding metadata ({e}); convert the TSV "
                             f"again") from e
        if not isinstance(info, dict) or info.get("version") != FORMAT_VERSION:
            version = info.get("version") if isinstance(info, dict) else info
            raise InputError(f"{path}: one_embedding Criteo format version {version!r}, "
                             f"this library reads {FORMAT_VERSION}; convert the TSV again")
        return "one_embedding"
    if SOURCE_KEY in metadata:
        return "oneflow"
    return None


def detect_schema(path, layout: str | None = None) -> str:
    """"one_embedding" or "oneflow": the layout of a Criteo Parquet file (module docstring).

    layout: None detects it from the metadata (ours when ``one_embedding.criteo`` is there,
    OneFlow's otherwise); a name overrides the detection for a file without our metadata, and an
    override that contradicts the file's metadata raises InputError. InputError also for anything
    that is not a Criteo file (unreadable footer, a missing column, a column of the wrong type).
    """
    path = os.fspath(path)
    _check_layout(layout)
    try:
        schema = pq.read_schema(path)
    except _ARROW_ERRORS as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from e
    stated = _metadata_layout(path, schema.metadata or {})
    if layout is not None and stated is not None and layout != stated:
        effect = ("take the log a second time" if layout == "oneflow"
                  else "leave raw + 1 values unlogged")
        raise InputError(f"{path}: layout={layout!r} but the file's metadata says it is "
                         f"{stated!r}; reading it as {layout!r} would {effect}: drop the layout "
                         f"option (the metadata decides)")
    kind = layout or stated or "oneflow"
    names = set(schema.names)
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise InputError(f"{path}: not a Criteo Parquet file, columns {missing} are missing "
                         f"(want label, I1..I13, C1..C26)")
    label_type = schema.field(LABEL_COLUMN).type
    if not (pa.types.is_floating(label_type) or pa.types.is_integer(label_type)
            or pa.types.is_boolean(label_type)):
        raise InputError(f"{path}: column {LABEL_COLUMN} is {label_type}, expected float labels "
                         f"0/1 (convert the column, e.g. with pyarrow.compute.cast, or write the "
                         f"file again)")
    for name in DENSE_COLUMNS:
        dense_type = schema.field(name).type
        # OneFlow's Python tool writes raw + 1 as int32; 64-bit integers there are the DCN /
        # DeepFM layout, where I1..I13 are categorical keys
        small_int = pa.types.is_integer(dense_type) and dense_type.bit_width <= 32
        if not (pa.types.is_floating(dense_type) or (kind == "oneflow" and small_int)):
            raise InputError(f"{path}: column {name} is {dense_type}, expected float "
                             f"(OneFlow's raw + 1, or int32); files with I1..I13 as categorical "
                             f"keys (OneFlow's DCN/DeepFM layout) are not read by ParquetReader")
    for name in SPARSE_COLUMNS:
        if not pa.types.is_integer(schema.field(name).type):
            raise InputError(f"{path}: column {name} is {schema.field(name).type}, "
                             f"expected int64 keys")
    return kind


def oneflow_dense(raw_plus_one: np.ndarray) -> np.ndarray:
    """OneFlow's dense values ``raw + 1`` (missing -> 1) -> ``log(max(raw, 0) + 1)`` float32,
    computed as ``schema.dense_log`` computes it from the raw value, so both layouts of a row give
    the same bits. raw_plus_one: (N, 13) any real dtype -> (N, 13) float32."""
    raw = np.asarray(raw_plus_one, dtype=np.float64) - 1.0
    np.maximum(raw, 0.0, out=raw)
    return np.log1p(raw).astype(np.float32)


def _column(table: pa.Table, name: str, dtype, where: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise InputError(f"{where}column {name} has {col.null_count} nulls; Criteo Parquet files "
                         f"encode missing values (OneFlow: I=1; ours: I=0, C=reserved key), not "
                         f"nulls")
    return col.to_numpy().astype(dtype, copy=False)


def _check_finite(dense: np.ndarray, first_row: int, where: str) -> None:
    """InputError naming the first NaN or infinite dense value (the model would refuse it later
    without the file and row)."""
    bad = ~np.isfinite(dense)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise InputError(f"{where}row {first_row + row}: I{col + 1} is {dense[row, col]}; "
                         f"Criteo's dense features are finite numbers (missing -> 0 in ours, "
                         f"1 in OneFlow's): fix the file")


def table_to_chunk(table: pa.Table, schema: str, first_row: int, where: str = "",
                   keys: str = "global") -> Chunk:
    """Arrow table (one Criteo schema) -> Chunk; positions = first_row + arange(N).
    where: prefix of error messages (the file and row group); keys: how the C columns' ids
    become keys (``parquet_inputs``: "global" as stored, or "per_column")."""
    n = table.num_rows
    labels = _column(table, LABEL_COLUMN, np.float32, where)
    outside = (labels < 0) | (labels > 1) | np.isinf(labels)  # NaN: an unlabelled file's
    if outside.any():
        at = int(np.argmax(outside))
        raise InputError(f"{where}row {first_row + at}: label {labels[at]} is not a click "
                         "label (1 = click, 0 = no click)")
    if schema == "oneflow":
        # float64 holds every float32 / int32 raw + 1 exactly: the log is taken once, here
        raw_plus_one = np.empty((n, NUM_DENSE), np.float64)
        for j, name in enumerate(DENSE_COLUMNS):
            raw_plus_one[:, j] = _column(table, name, np.float64, where)
        _check_finite(raw_plus_one, first_row, where)
        check_oneflow_dense(raw_plus_one, first_row, where)
        dense = oneflow_dense(raw_plus_one)
    else:
        dense = np.empty((n, NUM_DENSE), np.float32)
        for j, name in enumerate(DENSE_COLUMNS):
            dense[:, j] = _column(table, name, np.float32, where)
        _check_finite(dense, first_row, where)
    ids = np.empty((n, NUM_SPARSE), np.int64)
    for j, name in enumerate(SPARSE_COLUMNS):
        ids[:, j] = key_column(_column(table, name, np.int64, where), j, keys, first_row, where)
    return Chunk(dense, ids, labels, np.arange(first_row, first_row + n, dtype=np.int64))


class ParquetReader:
    """Streams Criteo Parquet files (ours or OneFlow's, detected per file) as ``Chunk`` objects.

    layout: None (detect each file's layout from its metadata), or "one_embedding" / "oneflow"
    for files without our metadata (``detect_schema``); ``schemas`` lists each file's layout.
    keys: None (decide per file), "global" or "per_column": how the C columns' ids become keys
    (``parquet_inputs``); ``key_modes`` lists each file's.
    Work is divided into units of one row group each (``units()``), which the loader shards over
    ranks. Chunk positions are ``file_index << 44 | row index within the file``.
    """

    def __init__(self, path_or_paths, *, batch_rows: int = 65536, layout: str | None = None,
                 keys: str | None = None):
        self.paths = _paths(path_or_paths)
        if not (isinstance(batch_rows, (int, np.integer)) and batch_rows >= 1):
            raise ConfigError(f"batch_rows={batch_rows!r}: use a positive count, e.g. 65536")
        self.batch_rows = int(batch_rows)
        self.layout = _check_layout(layout)
        self.keys = check_keys(keys)
        self.schemas = [detect_schema(p, layout) for p in self.paths]
        #: each file's key mode, "global" or "per_column" (``parquet_inputs``)
        self.key_modes = []
        self._row_groups = []
        for p in self.paths:
            meta = pq.ParquetFile(p).metadata
            _refuse_summary_file(p, meta)
            ours = _metadata_layout(p, meta.metadata or {}) is not None
            self.key_modes.append(decide_keys(p, self.keys, ours, meta))
            self._row_groups.append([meta.row_group(g).num_rows
                                     for g in range(meta.num_row_groups)])
        self.skipped = 0

    @property
    def num_rows(self) -> int:
        return sum(sum(g) for g in self._row_groups)

    def units(self, min_units: int = 1) -> list[tuple[int, int]]:
        """(file index, row group index) for every non-empty row group, in file order (row groups
        are the finest split; ``min_units`` is accepted for the source protocol)."""
        return [(f, g) for f, groups in enumerate(self._row_groups)
                for g, rows in enumerate(groups) if rows]

    def chunk_positions(self, unit: tuple[int, int]) -> list[np.ndarray]:
        """The positions of each chunk ``read_unit(unit)`` yields (``batch_rows`` rows each, the
        last fewer), from the footer alone, nothing decoded: [(rows,) int64, ...]. The loader
        uses it to skip work when it resumes."""
        file_index, group = unit
        first_row = sum(self._row_groups[file_index][:group])
        rows = np.arange(first_row, first_row + self._row_groups[file_index][group], dtype=np.int64)
        rows |= np.int64(file_index << FILE_SHIFT)
        return [rows[lo:lo + self.batch_rows] for lo in range(0, len(rows), self.batch_rows)]

    def read_unit(self, unit: tuple[int, int]) -> Iterator[Chunk]:
        file_index, group = unit
        path = self.paths[file_index]
        first_row = sum(self._row_groups[file_index][:group])
        where = f"{path}: row group {group}: "
        try:
            # page checksums are verified where the file has them (ours do)
            parquet = pq.ParquetFile(path, page_checksum_verification=True)
            # one thread per row group: the loader decodes several row groups at once on its
            # worker threads (pyarrow's own pool on top of them was slower: measured 2.6x)
            batches = parquet.iter_batches(batch_size=self.batch_rows, row_groups=[group],
                                           columns=list(COLUMNS), use_threads=False)
            for table in _exact_tables(batches, self.batch_rows):
                chunk = table_to_chunk(table, self.schemas[file_index], first_row, where,
                                       self.key_modes[file_index])
                chunk.positions |= np.int64(file_index << FILE_SHIFT)
                yield chunk
                first_row += table.num_rows
        except _ARROW_ERRORS as e:
            reason = " ".join(str(e).split())      # pyarrow's message may span lines
            raise InputError(f"{where}{_damaged_column(path, group)}damaged or unreadable data "
                             f"({reason}); the file is corrupt: write or download it again") from e

    def __iter__(self) -> Iterator[Chunk]:
        for unit in self.units():
            yield from self.read_unit(unit)


def _refuse_summary_file(path: str, meta) -> None:
    """InputError for a dataset's summary file (Dask's / Spark's ``_metadata``): a footer whose
    row groups live in other files, which reading it as data would fail on mid-run."""
    if meta.num_row_groups and meta.num_columns and meta.row_group(0).column(0).file_path:
        raise InputError(f"{path} is a dataset's summary file: its row groups live in "
                         f"{meta.row_group(0).column(0).file_path} and the other part files; "
                         f"pass those (or the folder, whose '_' files are skipped)")


def _exact_tables(batches, rows: int) -> Iterator[pa.Table]:
    """Record batches as tables of exactly ``rows`` rows (the last may be shorter). pyarrow cuts
    a row group so already; this makes sure, because ``chunk_positions`` promises it."""
    pending: list = []
    pending_rows = 0
    for batch in batches:
        if not pending and batch.num_rows == rows:
            yield pa.Table.from_batches([batch])
            continue
        pending.append(batch)
        pending_rows += batch.num_rows
        while pending_rows >= rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, rows)
            rest = table.slice(rows)
            pending, pending_rows = rest.to_batches(), rest.num_rows
    if pending_rows:
        yield pa.Table.from_batches(pending)


def _damaged_column(path: str, group: int) -> str:
    """"column NAME: " for the first Criteo column of the row group that fails to read on its
    own ("" if none does alone). Runs only after a read failed, to name the culprit."""
    try:
        parquet = pq.ParquetFile(path, page_checksum_verification=True)
    except _ARROW_ERRORS:
        return ""
    for name in COLUMNS:
        try:
            parquet.read_row_group(group, columns=[name])
        except _ARROW_ERRORS:
            return f"column {name}: "
    return ""


def chunk_to_table(chunk: Chunk, metadata: dict, layout: str = "one_embedding",
                   paths: Sequence[str] = ()) -> pa.Table:
    """Chunk -> Arrow table in ``parquet_schema(layout)``, carrying ``metadata`` as JSON under
    METADATA_KEY (our layout) or SOURCE_KEY (OneFlow's, whose chunk.dense holds raw + 1).
    paths: the TSV files the chunk's positions index (``file << FILE_SHIFT | byte offset``), to
    name the file of a value OneFlow's layout cannot hold."""
    dense = chunk.dense
    if layout == "oneflow":
        info = np.iinfo(np.int32)
        outside = (dense < info.min) | (dense > info.max)
        if outside.any():
            row, col = (int(v) for v in np.argwhere(outside)[0])
            pos = int(chunk.positions[row])
            file, offset = pos >> FILE_SHIFT, pos & ((1 << FILE_SHIFT) - 1)
            name = paths[file] if file < len(paths) else f"file {file}"
            raw = float(dense[row, col]) - 1     # float64: exact below 2**53
            shown = f"{int(raw)}" if abs(raw) < 2.0 ** 53 else f"about {raw:.6g}"
            raise InputError(f"{name}: the line at byte {offset}: I{col + 1} = {shown} "
                             f"does not fit OneFlow's int32 raw + 1: "
                             f"write layout='one_embedding' (--layout one_embedding) instead")
        dense = dense.astype(np.int32)
    schema = parquet_schema(layout)
    arrays = [pa.array(chunk.labels, pa.float32())]
    arrays += [pa.array(np.ascontiguousarray(dense[:, j]), schema.field(name).type)
               for j, name in enumerate(DENSE_COLUMNS)]
    arrays += [pa.array(np.ascontiguousarray(chunk.ids[:, j]), pa.int64())
               for j in range(NUM_SPARSE)]
    key = SOURCE_KEY if layout == "oneflow" else METADATA_KEY
    schema = schema.with_metadata({key: json.dumps(metadata).encode()})
    return pa.Table.from_arrays(arrays, schema=schema)


class _RawDenseTSVReader(CriteoTSVReader):
    """A CriteoTSVReader whose chunks hold OneFlow's dense values, ``raw + 1`` (missing -> 1) as
    float64 (exact), in place of ``log(max(x, 0) + 1)``: the log cannot be undone exactly, so each
    block is scanned a second time for the raw integers (a conversion to OneFlow's layout took
    10-30% longer than to ours, 27 MB on 2 cores). Bad lines, ranges and counts are the
    parent's."""

    def _parse(self, data: bytes, file_offset: int, stop, final: bool = False) -> Chunk:
        from .tsv_kernel import scan_lines

        chunk = super()._parse(data, file_offset, stop, final)
        if not len(chunk):
            return chunk
        min_fields, max_fields = self._field_range()
        _, raw, present, _, _, starts, _ = scan_lines(
            np.frombuffer(data, dtype=np.uint8), self.has_label, min_fields, max_fields,
            self.max_hex_digits)
        rows = np.searchsorted(starts, chunk.positions - file_offset)  # the lines kept
        dense = np.where(present[rows], raw[rows].astype(np.float64) + 1.0, 1.0)
        return Chunk(dense, chunk.ids, chunk.labels, chunk.positions)


def _check_convert_paths(paths: list[str], dst: str, overwrite: bool) -> None:
    """InputError, before anything is written, for a source that is missing, a folder or already
    Parquet, and for a destination that is one of the sources, a folder, lies in a missing folder
    or exists (unless ``overwrite``)."""
    for path in paths:
        if is_parquet_file(path):  # also refuses missing paths and folders
            raise InputError(f"{path} is already a Parquet file: train on it directly, or pass "
                             f"the raw Criteo TSV file to convert")
        if os.path.exists(dst) and os.path.samefile(path, dst):
            raise InputError(f"output {dst} is also a source: name a new .parquet file as the "
                             "last argument (the sources come before it)")
    if os.path.isdir(dst):
        stem = os.path.splitext(os.path.basename(paths[0]))[0]
        raise InputError(f"output {dst} is a folder: name the output file, e.g. "
                         f"{os.path.join(dst, stem + '.parquet')}")
    folder = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(folder):
        raise InputError(f"output {dst}: folder {folder} does not exist; create it first")
    if os.path.exists(dst) and not overwrite:
        raise InputError(f"output {dst} exists: pass --overwrite (overwrite=True) to replace it, "
                         "or name a new file")


def convert_tsv_to_parquet(src, dst, *, has_label: bool = True,
                           key_scheme: KeyScheme = KeyScheme(), on_bad_line: str = "error",
                           row_group_rows: int = 1 << 18, compression: str = "snappy",
                           progress: bool = True, block_bytes: int = 1 << 20,
                           max_hex_digits: int | None = None,
                           layout: str = "one_embedding", overwrite: bool = False) -> dict:
    """Stream raw Criteo TSV file(s) ``src`` into one Parquet file ``dst`` (an existing ``dst``
    only with ``overwrite``; never one of the sources).

    layout: "one_embedding" (ours: dense ``log(max(x, 0) + 1)``) or "oneflow" (OneFlow's: dense
    ``raw + 1`` int32, missing -> 1, the log taken by the reader; module docstring). Both
    layouts of a source read back as the same batches.

    Memory stays near one row group (``row_group_rows`` x 264 bytes) plus one TSV block. The file is
    written under a temporary name and renamed when complete. A tqdm bar counts input bytes.
    max_hex_digits: longest categorical accepted, default ``default_max_hex_digits(key_scheme)``
    (16 under the default key scheme, where a wider value would fold). A missing source, a folder
    or a Parquet file as source, and a folder as ``dst`` are refused (InputError) up front;
    sources that hold no row (empty, or every line skipped) after the fact, with no file
    written. Returns {"rows": int, "skipped": int, "row_groups": int}.
    """
    from tqdm import tqdm

    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows={row_group_rows}: use a positive count, e.g. 262144")
    if _check_layout(layout) is None:
        raise ConfigError("layout=None: converting needs a layout to write, 'one_embedding' or "
                          "'oneflow'")
    paths = _paths(src)
    dst = os.fspath(dst)
    _check_convert_paths(paths, dst, overwrite)
    if max_hex_digits is None:
        max_hex_digits = default_max_hex_digits(key_scheme)
    scheme = {"mode": key_scheme.mode, "mod": int(key_scheme.mod)}
    if layout == "oneflow":
        key, reader_class = SOURCE_KEY, _RawDenseTSVReader
        metadata = {"layout": "oneflow", "dense": "raw_plus_one", "has_label": has_label,
                    "key_scheme": scheme}
    else:
        key, reader_class = METADATA_KEY, CriteoTSVReader
        metadata = {"version": FORMAT_VERSION, "dense": "log1p", "has_label": has_label,
                    "key_scheme": scheme}
    schema = parquet_schema(layout).with_metadata({key: json.dumps(metadata).encode()})
    # a name of its own beside dst (dst + ".tmp" could be a file of the user's)
    tmp = os.path.join(os.path.dirname(os.path.abspath(dst)),
                       f".{os.path.basename(dst)}.{uuid.uuid4().hex[:12]}.tmp")
    total_bytes = sum(os.path.getsize(p) for p in paths)
    rows = skipped = groups = 0
    pending: list[Chunk] = []
    pending_rows = 0

    def flush(writer, final: bool):
        nonlocal pending, pending_rows, groups, rows
        while pending_rows >= row_group_rows or (final and pending_rows):
            merged = Chunk(*(np.concatenate([getattr(c, k) for c in pending])
                             for k in ("dense", "ids", "labels", "positions")))
            take = min(row_group_rows, pending_rows)
            writer.write_table(chunk_to_table(merged.take(slice(0, take)), metadata, layout,
                                              paths),
                               row_group_size=row_group_rows)
            groups += 1
            rows += take
            rest = merged.take(slice(take, None))
            pending, pending_rows = ([rest] if len(rest) else []), len(rest)

    try:
        with pq.ParquetWriter(tmp, schema, compression=compression,
                              write_page_checksum=True) as writer, \
                tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress,
                     desc="convert") as bar:
            for path in paths:
                reader = reader_class(path, has_label=has_label, key_scheme=key_scheme,
                                         on_bad_line=on_bad_line, block_bytes=block_bytes,
                                         max_hex_digits=max_hex_digits)
                done = 0
                for chunk in reader:
                    pending.append(chunk)
                    pending_rows += len(chunk)
                    flush(writer, final=False)
                    reached = int(chunk.positions[-1])
                    bar.update(reached - done)
                    done = reached
                bar.update(os.path.getsize(path) - done)
                skipped += reader.skipped
            flush(writer, final=True)
        if rows == 0:
            raise InputError(f"{', '.join(paths)}: no row to convert ("
                             + (f"all {skipped:,} lines were malformed and skipped"
                                if skipped else "no line") + "); nothing was written")
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"rows": rows, "skipped": skipped, "row_groups": groups}


def write_parquet(dst, batches: Sequence, *, key_scheme: KeyScheme = KeyScheme(),
                  has_label: bool = True, row_group_rows: int = 1 << 18) -> None:
    """Write in-memory Batches (e.g. synthetic data) to one Parquet file in our schema."""
    metadata = {"version": FORMAT_VERSION, "dense": "log1p", "has_label": has_label,
                "key_scheme": {"mode": key_scheme.mode, "mod": int(key_scheme.mod)}}
    schema = parquet_schema().with_metadata({METADATA_KEY: json.dumps(metadata).encode()})
    with pq.ParquetWriter(os.fspath(dst), schema, write_page_checksum=True) as writer:
        for b in batches:
            chunk = Chunk(b.dense, b.ids, b.labels, np.zeros(len(b), np.int64))
            writer.write_table(chunk_to_table(chunk, metadata), row_group_size=row_group_rows)
