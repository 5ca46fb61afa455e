"""Criteo in Parquet: OneFlow's files, our own, and the streaming TSV -> Parquet converter.

Two schemas are read, told apart by the file's key-value metadata:

* **ours** (metadata key ``one_embedding.criteo`` holds JSON ``{"version": 1, "dense": "log1p",
  "key_scheme": {...}, "has_label": ...}``): ``label`` float32 (NaN when the source had no label),
  ``I1..I13`` float32 already ``log(max(x, 0) + 1)`` with missing -> 0, ``C1..C26`` int64 global
  keys (``schema.KeyScheme``). Batches come out unchanged.
* **OneFlow** (no such metadata): ``label`` float, ``I1..I13`` float holding ``raw + 1`` with
  missing -> 1 (the ``log`` is taken at training time), ``C1..C26`` int64 already global keys.
  Batches get ``dense = log(max(I, 1))``, i.e. negatives clamped as in ``schema.dense_log``.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, InputError
from .schema import (DENSE_COLUMNS, LABEL_COLUMN, NUM_DENSE, NUM_SPARSE, SPARSE_COLUMNS,
                     KeyScheme)
from .tsv import FILE_SHIFT, Chunk, CriteoTSVReader

METADATA_KEY = b"one_embedding.criteo"
FORMAT_VERSION = 1


def _paths(path_or_paths) -> list[str]:
    if isinstance(path_or_paths, (str, os.PathLike)):
        return [os.fspath(path_or_paths)]
    paths = [os.fspath(p) for p in path_or_paths]
    if not paths:
        raise ConfigError("no input files: pass a path or a non-empty list of paths")
    return paths


def parquet_schema() -> pa.Schema:
    """Our Parquet schema (without metadata): label float32, I1..I13 float32, C1..C26 int64."""
    fields = [pa.field(LABEL_COLUMN, pa.float32())]
    fields += [pa.field(name, pa.float32()) for name in DENSE_COLUMNS]
    fields += [pa.field(name, pa.int64()) for name in SPARSE_COLUMNS]
    return pa.schema(fields)


def detect_schema(path) -> str:
    """"one_embedding" or "oneflow" for a Criteo Parquet file; InputError for anything else."""
    try:
        schema = pq.read_schema(os.fspath(path))
    except (OSError, pa.ArrowInvalid) as e:
        raise InputError(f"{os.fspath(path)}: not a readable Parquet file ({e})") from e
    metadata = schema.metadata or {}
    if METADATA_KEY in metadata:
        info = json.loads(metadata[METADATA_KEY])
        if info.get("version") != FORMAT_VERSION:
            raise InputError(f"{path}: one_embedding Criteo format version {info.get('version')}, "
                             f"this library reads {FORMAT_VERSION}; convert the TSV again")
        return "one_embedding"
    names = set(schema.names)
    missing = [c for c in (LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS) if c not in names]
    if missing:
        raise InputError(f"{path}: not a Criteo Parquet file, columns {missing} are missing "
                         f"(want label, I1..I13, C1..C26)")
    for name in DENSE_COLUMNS:
        if not pa.types.is_floating(schema.field(name).type):
            raise InputError(f"{path}: column {name} is {schema.field(name).type}, expected float "
                             f"(OneFlow's raw + 1); files with I1..I13 as categorical keys "
                             f"(OneFlow's DCN/DeepFM layout) are not read by ParquetReader")
    for name in SPARSE_COLUMNS:
        if not pa.types.is_integer(schema.field(name).type):
            raise InputError(f"{path}: column {name} is {schema.field(name).type}, "
                             f"expected int64 keys")
    return "oneflow"


def _column(table: pa.Table, name: str, dtype) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise InputError(f"column {name} has {col.null_count} nulls; Criteo Parquet files encode "
                         f"missing values (OneFlow: I=1; ours: I=0, C=reserved key), not nulls")
    return col.to_numpy().astype(dtype, copy=False)


def table_to_chunk(table: pa.Table, schema: str, first_row: int) -> Chunk:
    """Arrow table (one Criteo schema) -> Chunk; positions = first_row + arange(N)."""
    n = table.num_rows
    labels = _column(table, LABEL_COLUMN, np.float32)
    dense = np.empty((n, NUM_DENSE), np.float32)
    for j, name in enumerate(DENSE_COLUMNS):
        dense[:, j] = _column(table, name, np.float32)
    if schema == "oneflow":
        dense = np.log(np.maximum(dense, np.float32(1.0)))
    ids = np.empty((n, NUM_SPARSE), np.int64)
    for j, name in enumerate(SPARSE_COLUMNS):
        ids[:, j] = _column(table, name, np.int64)
    return Chunk(dense, ids, labels, np.arange(first_row, first_row + n, dtype=np.int64))


class ParquetReader:
    """Streams Criteo Parquet files (ours or OneFlow's, detected per file) as ``Chunk`` objects.

    Work is divided into units of one row group each (``units()``), which the loader shards over
    ranks. Chunk positions are ``file_index << 44 | row index within the file``.
    """

    def __init__(self, path_or_paths, *, batch_rows: int = 65536):
        self.paths = _paths(path_or_paths)
        self.batch_rows = int(batch_rows)
        self.schemas = [detect_schema(p) for p in self.paths]
        self._row_groups = []
        for p in self.paths:
            meta = pq.ParquetFile(p).metadata
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

    def read_unit(self, unit: tuple[int, int]) -> Iterator[Chunk]:
        file_index, group = unit
        first_row = sum(self._row_groups[file_index][:group])
        parquet = pq.ParquetFile(self.paths[file_index])
        columns = [LABEL_COLUMN, *DENSE_COLUMNS, *SPARSE_COLUMNS]
        for batch in parquet.iter_batches(batch_size=self.batch_rows, row_groups=[group],
                                          columns=columns):
            table = pa.Table.from_batches([batch])
            chunk = table_to_chunk(table, self.schemas[file_index], first_row)
            chunk.positions |= np.int64(file_index << FILE_SHIFT)
            yield chunk
            first_row += table.num_rows

    def __iter__(self) -> Iterator[Chunk]:
        for unit in self.units():
            yield from self.read_unit(unit)


def chunk_to_table(chunk: Chunk, metadata: dict) -> pa.Table:
    """Chunk -> Arrow table in our schema, carrying ``metadata`` as JSON under METADATA_KEY."""
    arrays = [pa.array(chunk.labels, pa.float32())]
    arrays += [pa.array(np.ascontiguousarray(chunk.dense[:, j]), pa.float32())
               for j in range(NUM_DENSE)]
    arrays += [pa.array(np.ascontiguousarray(chunk.ids[:, j]), pa.int64())
               for j in range(NUM_SPARSE)]
    schema = parquet_schema().with_metadata({METADATA_KEY: json.dumps(metadata).encode()})
    return pa.Table.from_arrays(arrays, schema=schema)


def convert_tsv_to_parquet(src, dst, *, has_label: bool = True,
                           key_scheme: KeyScheme = KeyScheme(), on_bad_line: str = "error",
                           row_group_rows: int = 1 << 18, compression: str = "snappy",
                           progress: bool = True, block_bytes: int = 1 << 20) -> dict:
    """Stream raw Criteo TSV file(s) ``src`` into one Parquet file ``dst`` in our schema.

    Memory stays near one row group (``row_group_rows`` x 264 bytes) plus one TSV block. The file is
    written under a temporary name and renamed when complete. A tqdm bar counts input bytes.
    Returns {"rows": int, "skipped": int, "row_groups": int}.
    """
    from tqdm import tqdm

    if row_group_rows < 1:
        raise ConfigError(f"row_group_rows={row_group_rows}: use a positive count, e.g. 262144")
    paths = _paths(src)
    dst = os.fspath(dst)
    metadata = {"version": FORMAT_VERSION, "dense": "log1p", "has_label": has_label,
                "key_scheme": {"mode": key_scheme.mode, "mod": int(key_scheme.mod)}}
    schema = parquet_schema().with_metadata({METADATA_KEY: json.dumps(metadata).encode()})
    tmp = dst + ".tmp"
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
            writer.write_table(chunk_to_table(merged.take(slice(0, take)), metadata),
                               row_group_size=row_group_rows)
            groups += 1
            rows += take
            rest = merged.take(slice(take, None))
            pending, pending_rows = ([rest] if len(rest) else []), len(rest)

    try:
        with pq.ParquetWriter(tmp, schema, compression=compression) as writer, \
                tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress,
                     desc="convert") as bar:
            for path in paths:
                reader = CriteoTSVReader(path, has_label=has_label, key_scheme=key_scheme,
                                         on_bad_line=on_bad_line, block_bytes=block_bytes)
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
    with pq.ParquetWriter(os.fspath(dst), schema) as writer:
        for b in batches:
            chunk = Chunk(b.dense, b.ids, b.labels, np.zeros(len(b), np.int64))
            writer.write_table(chunk_to_table(chunk, metadata), row_group_size=row_group_rows)
