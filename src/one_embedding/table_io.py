"""OneFlow's persistent table reader and writer: rows in and out of snapshots, no embedding needed.

::

    with make_persistent_table_writer(paths, "pretrained", np.int64, np.float32, 64) as w:
        w.write(keys, values)            # keys (n,) ids, values (n, 64) whole lines
    emb.load_snapshot("pretrained")      # an embedding with line_size 64 serves those rows

    with make_persistent_table_reader(paths, "final", np.int64, np.float32, 64) as r:
        for keys, values in r:           # (k,) int64, (k, 64) float32 batches
            ...

``paths`` lists the per-rank table folders, rank order: ``["<persistent_path>/0-1"]`` for one
rank, ``["<p>/0-2", "<p>/1-2"]`` for two (the folders an embedding with ``persistent_path=<p>``
uses). The writer puts each key into the folder of its owner rank (``parallel.shuffle.owner_rank``),
so an embedding of that many ranks loads it directly and any other number of ranks re-shards it on
load. A value is a whole stored line of ``storage_dim`` floats: the embedding followed by the row
optimizer's state (zeros for a fresh SGD / Adagrad / Adam row), exactly what OneFlow's persistent
table holds.

Rows pass through the real store classes: the writer fills a store of the chosen engine (the
slot engine's segments in the rank folder's own pool, where its snapshots refer to them; a
RocksDB in a scratch folder under the rank folder's ``snapshots/``, deleted by the next
``recover`` if the process dies) and publishes it with ``SnapshotDirectory.save``, so a
writer-made snapshot is complete or absent, like any other. The reader reads through
``chain.read_snapshot_rows`` under a lease, so it reads snapshots of any engine, also those an
embedding saved (export a trained table), while that embedding's process may delete them.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from typing import Sequence

import numpy as np

from .chain import open_store_for_snapshot, read_snapshot_rows
from .embedding_inputs import dtype_name, keys_as_uint64, resolve_key_type
from .errors import ConfigError, InputError, SnapshotError
from .options import PHYSICAL_BLOCK_SIZES
from .parallel.shuffle import owner_rank
from .store.lock import PathLock
from .store.snapshots import SnapshotDirectory, check_snapshot_name

log = logging.getLogger(__name__)

#: The engines a writer can fill, by the ``engine`` keyword: the store name its manifest records.
ENGINES = {"slots": "ssd.slots", "rocksdb": "ssd.rocksdb"}
#: Rows per batch the reader yields (OneFlow's reader uses 65,536 too).
READ_BATCH_ROWS = 65_536


# ---------------------------------------------------------------- argument checks


def _check_paths(paths, placed: bool) -> list[str]:
    """paths: a list of per-rank folders (rank order). ``placed`` (the writer): a folder named
    ``<r>-<P>`` (the layout an embedding uses) must sit at position r of P paths, since a key goes
    to the folder of its owner among len(paths) ranks; a folder in the wrong place would give its
    rows to a rank that never looks them up. A reader may read any folders."""
    if isinstance(paths, (str, os.PathLike)):
        raise ConfigError(f"paths={paths!r} is one path: pass a list of per-rank table folders, "
                          f"e.g. [{os.path.join(os.fspath(paths), '0-1')!r}] for one rank")
    try:
        folders = [os.fspath(p) for p in paths]
    except TypeError:
        raise ConfigError(f"paths={paths!r} must be a list of folder paths (str or PathLike)") from None
    if not folders:
        raise ConfigError("paths is empty: give one table folder per rank, e.g. ['<path>/0-1']")
    real = [os.path.realpath(f) for f in folders]
    if len(set(real)) != len(real):
        raise ConfigError(f"paths={folders!r} names a folder twice: give one folder per rank")
    world = len(folders)
    for position, folder in enumerate(folders if placed else []):
        m = re.fullmatch(r"(\d+)-(\d+)", os.path.basename(os.path.normpath(folder)))
        if m and (int(m.group(1)), int(m.group(2))) != (position, world):
            rank, of = int(m.group(1)), int(m.group(2))
            width = len(str(world))  # an embedding's folder names: rank zero-padded
            raise ConfigError(
                f"paths[{position}]={folder!r} is the folder of rank {rank} of {of}, but the writer "
                f"puts into position {position} of {world} paths the keys rank {position} of "
                f"{world} owns: list the folders of all ranks in rank order ('{0:0{width}d}-{world}', "
                f"'{1:0{width}d}-{world}', ...)"
            )
    return folders


def _check_value_type(value_type) -> None:
    if dtype_name(value_type) != "float32":
        raise ConfigError(f"value_type={value_type!r}: stored lines are float32; pass np.float32")


def _check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive int")
    return int(value)


def _check_block_size(value) -> int:
    """physical_block_size as the stores take it (a power of two in 512..65536): a writer given
    1000 failed only at its first write, with a disk I/O error."""
    if isinstance(value, bool) or value not in PHYSICAL_BLOCK_SIZES:
        raise ConfigError(f"physical_block_size={value!r} must be a power of two in 512..65536 "
                          "(OneFlow's: 512 or 4096)")
    return int(value)


def _check_embedding_dims(embedding_dims, storage_dim: int) -> list[int] | None:
    """The embedding columns recorded in the manifest (``load_snapshot`` compares them with the
    loading embedding's); None (OneFlow's writer has no such argument): not recorded, so the
    lines load into any embedding whose line_size is ``storage_dim``, whatever its columns."""
    if embedding_dims is None:
        return None
    dims = [embedding_dims] if isinstance(embedding_dims, (int, np.integer)) else embedding_dims
    try:
        dims = list(dims)
    except TypeError:
        raise ConfigError(f"embedding_dims={embedding_dims!r} must be an int or a list of ints") from None
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d <= 0
                       for d in dims):
        raise ConfigError(f"embedding_dims={embedding_dims!r} must be a positive int or a list of them")
    dims = [int(d) for d in dims]
    if sum(dims) > storage_dim:
        raise ConfigError(
            f"embedding_dims={dims} (sum {sum(dims)}) do not fit in storage_dim={storage_dim}: a "
            "line is [embedding | optimizer state], so storage_dim >= sum(embedding_dims)"
        )
    return dims


def keys_from_uint64(keys: np.ndarray, key_type: np.dtype) -> np.ndarray:
    """The inverse of ``embedding.keys_as_uint64``: internal keys (n,) uint64 -> (n,) key_type."""
    if key_type.itemsize == 4:
        return keys.astype(np.uint32).view(key_type)
    return keys.view(key_type)


# ---------------------------------------------------------------- writer


class PersistentTableWriter:
    """Collects ``(keys, values)`` and publishes them as snapshot ``snapshot_name`` in every
    folder of ``paths`` when closed (see ``make_persistent_table_writer``)."""

    def __init__(self, paths: Sequence, snapshot_name: str, key_type, value_type,
                 storage_dim: int, physical_block_size: int = 4096, *, engine: str = "slots",
                 embedding_dims=None):
        # what __del__ and abort() release, set before any check can raise
        self._closed = False
        self._locks, self._snapshots, self._scratch, self._stores = [], [], [], []
        self.folders = _check_paths(paths, placed=True)
        self.snapshot_name = check_snapshot_name(snapshot_name)
        self.key_type = resolve_key_type(key_type)
        _check_value_type(value_type)
        self.storage_dim = _check_positive("storage_dim", storage_dim)
        self.physical_block_size = _check_block_size(physical_block_size)
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r} must be one of {sorted(ENGINES)}")
        self.engine = ENGINES[engine]
        self.embedding_dims = _check_embedding_dims(embedding_dims, self.storage_dim)
        #: values accepted by ``write`` so far (duplicates included)
        self.rows_written = 0
        #: rows that a later one of the same key replaced (within one write or across writes)
        self.replaced = 0
        try:
            for folder in self.folders:
                # the embedding's LOCK: no embedding may open this folder (its recover() would
                # delete our scratch) or save a snapshot into it while we write
                self._locks.append(PathLock(folder))
                snaps = SnapshotDirectory(folder)
                snaps.recover()  # scratch folders of writers that died
                scratch = os.path.join(snaps.root, f".tmp-table-writer-{uuid.uuid4().hex}")
                os.mkdir(scratch)
                self._snapshots.append(snaps)
                self._scratch.append(scratch)
                # the slot engine's segments go straight into the folder's pool (its snapshots
                # refer to them there); RocksDB builds its DB in the scratch folder and links
                home = folder if self.engine == ENGINES["slots"] else scratch
                self._stores.append(open_store_for_snapshot(self.engine, self.storage_dim, home,
                                                            self.physical_block_size))
        except BaseException:
            self._discard()
            raise

    def write(self, keys, values) -> None:
        """keys: (n,) integers that fit ``key_type``; values: (n, storage_dim) floats (cast to
        float32, must be finite). A key written again replaces its row: the last value wins,
        within one call (the last position) and across calls, as OneFlow's table does; the
        ``replaced`` attribute counts such rows."""
        if self._closed:
            raise InputError(f"write() on a closed table writer (snapshot {self.snapshot_name!r}): "
                             "open a new writer")
        keys, values = self._check_rows(keys, values)
        n = keys.shape[0]
        if n == 0:
            return
        internal = keys_as_uint64(keys, self.key_type)
        # keep each key's last occurrence: the stores take unique keys
        unique, last_in_reversed = np.unique(internal[::-1], return_index=True)
        if unique.shape[0] < n:
            rows = n - 1 - last_in_reversed
            internal, values = unique, values[rows]
        owners = owner_rank(internal, len(self.folders))
        for rank, store in enumerate(self._stores):
            mine = owners == rank
            if not mine.any():
                continue
            before = len(store)
            store.insert_or_assign(internal[mine], np.ascontiguousarray(values[mine]))
            self.replaced += int(mine.sum()) - (len(store) - before)
        self.replaced += n - internal.shape[0]
        self.rows_written += n

    def _check_rows(self, keys, values) -> tuple[np.ndarray, np.ndarray]:
        keys, values = np.asarray(keys), np.asarray(values)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise InputError(f"keys have shape {keys.shape} and dtype {keys.dtype}: pass a (n,) "
                             f"integer array ({self.key_type.name})")
        if values.shape != (keys.shape[0], self.storage_dim):
            raise InputError(f"values have shape {values.shape} for {keys.shape[0]} keys: pass "
                             f"({keys.shape[0]}, storage_dim={self.storage_dim})")
        if values.dtype.kind != "f":
            raise InputError(f"values have dtype {values.dtype}: pass float32 values")
        if keys.size:
            info = np.iinfo(self.key_type)
            lo, hi = int(keys.min()), int(keys.max())
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise InputError(f"key {bad} does not fit key_type={self.key_type.name} "
                                 f"[{info.min}, {info.max}]: use a wider key_type")
        values = values.astype(np.float32, copy=False)
        finite = np.isfinite(values).all(axis=1)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise InputError(f"values[{bad}] (key {int(keys[bad])}) is not finite: rows must hold "
                             "finite numbers; nothing of this write was stored")
        return keys, values

    def close(self) -> list[dict]:
        """Publish the snapshot in every folder (each atomically, folder by folder); returns the
        manifests. Closing twice does nothing the second time."""
        if self._closed:
            return []
        self._closed = True
        manifests = []
        try:
            world = len(self.folders)
            for rank, (store, snaps) in enumerate(zip(self._stores, self._snapshots)):
                manifest = {
                    "key_type": self.key_type.name,
                    "embedding_dims": self.embedding_dims,
                    "line_size": self.storage_dim,
                    "engine": store.name,
                    "row_count": len(store),
                    "rank": rank,
                    "world_size": world,
                    "embedding_name": None,
                    "store_kind": "table_writer",
                    "optimizer": None,  # unknown: any row optimizer may load these lines
                }
                manifests.append(snaps.save(self.snapshot_name, store.save_snapshot, manifest))
        finally:
            self._discard()
        return manifests

    def abort(self) -> None:
        """Drop everything written; no snapshot is published (an older one stays as it was)."""
        self._closed = True
        self._discard()

    def _discard(self) -> None:
        for store in self._stores:
            store.close()
        for scratch in self._scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        for lock in self._locks:
            lock.release()
        self._stores, self._scratch, self._locks = [], [], []

    def __enter__(self) -> "PersistentTableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # unlike OneFlow (which saves on any exit), a with-block that raised publishes nothing:
        # a half-written table must not replace a good snapshot of the same name
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self):
        try:
            self._discard()
        except Exception as e:  # garbage collection cannot raise: the reason is logged
            log.warning("a table writer was neither closed nor aborted, and discarding it at "
                        "garbage collection failed: %r", e)


def make_persistent_table_writer(paths, snapshot_name, key_type, value_type, storage_dim,
                                 physical_block_size=4096, *, engine="slots",
                                 embedding_dims=None) -> PersistentTableWriter:
    """A writer (context manager) that creates snapshot ``snapshot_name`` in each rank folder of
    ``paths`` from ``write(keys (n,), values (n, storage_dim))`` calls, published on a clean exit
    of the ``with`` block (or ``close()``), replacing a snapshot of that name; a block that raises
    publishes nothing. While open, the writer holds each folder's LOCK (no embedding may use it).

    key_type: int32 | int64 | uint32 | uint64 (numpy, string or framework dtype); value_type:
    float32; storage_dim: floats per line (the loading embedding's ``line_size``: ``size_factor *
    embedding_dim``, or its ``storage_dim``); physical_block_size: the slot engine's block size.
    Beyond OneFlow's arguments: ``engine`` "slots" or "rocksdb" (any engine loads into any store);
    ``embedding_dims`` (int or list, default ``[storage_dim]``): the embedding columns at the
    front of each line, compared by ``load_snapshot`` with the loading embedding's
    ``embedding_dim`` (pass it when the lines also hold optimizer state).

    Example: 3 rows for an SGD embedding of dim 4, loaded by it.

    >>> import tempfile, numpy as np, one_embedding as oe
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = folder.name
    >>> with oe.make_persistent_table_writer([f"{path}/0-1"], "pre", np.int64, np.float32, 4) as w:
    ...     w.write(np.array([7, 8, 9]), np.ones((3, 4)))
    >>> store = oe.make_device_mem_store_options(path, capacity=10)
    >>> emb = oe.MultiTableEmbedding("e", 4, np.float32, np.int64, None, store)
    >>> _ = emb.load_snapshot("pre")
    >>> emb(np.array([8]))
    array([[1., 1., 1., 1.]], dtype=float32)
    >>> emb.close()
    >>> folder.cleanup()
    """
    return PersistentTableWriter(paths, snapshot_name, key_type, value_type, storage_dim,
                                 physical_block_size, engine=engine, embedding_dims=embedding_dims)


# ---------------------------------------------------------------- reader


class PersistentTableReader:
    """Iterates ``(keys, values)`` of snapshot ``snapshot_name`` in every folder of ``paths``
    (see ``make_persistent_table_reader``)."""

    def __init__(self, paths: Sequence, snapshot_name: str, key_type, value_type,
                 storage_dim: int, physical_block_size: int = 4096, *, engine: str | None = None,
                 batch_rows: int = READ_BATCH_ROWS):
        self.folders = _check_paths(paths, placed=False)
        self.snapshot_name = check_snapshot_name(snapshot_name)
        self.key_type = resolve_key_type(key_type)
        _check_value_type(value_type)
        self.storage_dim = _check_positive("storage_dim", storage_dim)
        # the engine that wrote each folder's snapshot reads it back: the block size is the
        # snapshot's own, this argument is accepted for OneFlow's signature and checked only
        self.physical_block_size = _check_block_size(physical_block_size)
        if engine is not None and engine not in ENGINES:
            raise ConfigError(f"engine={engine!r} must be one of {sorted(ENGINES)} or None (the "
                              "engine each snapshot's manifest names)")
        self.batch_rows = _check_positive("batch_rows", batch_rows)
        want = {"key_type": self.key_type.name, "line_size": self.storage_dim}
        # open (and checksum) every folder's snapshot now: a bad argument fails before any row
        self._opened = []
        for folder in self.folders:
            if not os.path.isdir(folder):
                raise SnapshotError(f"table folder {folder!r} does not exist: pass the per-rank "
                                    "folders a writer or an embedding created")
            found, manifest = SnapshotDirectory(folder, create=False).open(self.snapshot_name, want)
            if engine is not None and manifest.get("engine") != ENGINES[engine]:
                raise SnapshotError(
                    f"snapshot {self.snapshot_name!r} in {folder!r} was written by engine "
                    f"{manifest.get('engine')!r}, not {ENGINES[engine]!r}: pass engine=None to read "
                    "it with the engine its manifest names"
                )
            self._opened.append((found, manifest))
        #: the manifest of each folder's snapshot, in ``paths`` order
        self.manifests = [m for _, m in self._opened]
        self._rows = self._iter_rows()

    def _iter_rows(self):
        for folder, manifest in self._opened:
            # a table with eviction stores its rows' last-seen step and frequency behind the
            # line: read whole stored lines, hand out the line
            stored = self.storage_dim + int(manifest.get("lifecycle_columns", 0))
            for keys, lines in read_snapshot_rows(folder, manifest["engine"], stored,
                                                  self.batch_rows):
                if stored != self.storage_dim:
                    lines = np.ascontiguousarray(lines[:, :self.storage_dim])
                yield keys_from_uint64(keys, self.key_type), lines

    def __iter__(self) -> "PersistentTableReader":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch: keys (k,) key_type; values (k, storage_dim) float32. Folders in
        ``paths`` order; within a folder, keys ascending as unsigned 64-bit numbers."""
        return next(self._rows)

    def close(self) -> None:
        """Stop reading (removes the scratch copy of the folder being read)."""
        self._rows.close()

    def __enter__(self) -> "PersistentTableReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_persistent_table_reader(paths, snapshot_name, key_type, value_type, storage_dim,
                                 physical_block_size=4096, *, engine=None,
                                 batch_rows=READ_BATCH_ROWS) -> PersistentTableReader:
    """A reader (context manager and iterator) of snapshot ``snapshot_name`` in each rank folder of
    ``paths``: yields ``(keys (k,) key_type, values (k, storage_dim) float32)`` batches of up to
    ``batch_rows`` rows, folder by folder (keys ascending as unsigned 64-bit numbers within a
    folder, so a negative key comes last); every key once.

    Reads snapshots of any engine, written by ``make_persistent_table_writer`` or saved by an
    embedding (``storage_dim`` is then its ``line_size``). The manifests must say ``key_type``
    and ``line_size == storage_dim`` (SnapshotError otherwise); ``engine`` (optional) must match
    the manifests' when given.

    >>> import tempfile, numpy as np, one_embedding as oe
    >>> folder = tempfile.TemporaryDirectory()
    >>> paths = [f"{folder.name}/0-1"]
    >>> with oe.make_persistent_table_writer(paths, "s", np.int32, np.float32, 2) as w:
    ...     w.write(np.array([5, -1], np.int32), np.array([[1, 2], [3, 4]], np.float32))
    >>> with oe.make_persistent_table_reader(paths, "s", np.int32, np.float32, 2) as r:
    ...     for keys, values in r:
    ...         print(keys, values.tolist())
    [ 5 -1] [[1.0, 2.0], [3.0, 4.0]]
    >>> folder.cleanup()
    """
    return PersistentTableReader(paths, snapshot_name, key_type, value_type, storage_dim,
                                 physical_block_size, engine=engine, batch_rows=batch_rows)
