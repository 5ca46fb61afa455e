"""A trained table served read-only: a RAM cache over the snapshot's rows where they lie.

One ``SnapshotRows`` per rank folder of the snapshot: an SSD snapshot (slots, RocksDB) is opened
through a private store in a scratch folder, which reads the snapshot's files in place (the
slots engine keeps its ~6 B/key directory in RAM, RocksDB its table readers); a memory store's
snapshot (``keys.npy`` sorted + ``lines.npy``) is memory-mapped and searched by binary search, so
neither is read whole. A lease on every folder (taken by the caller, before it checked the
files) keeps the files on disk while they are served, even when the training run's retention
deletes the snapshot meanwhile.

A row that fails its checksum while served is a StoreError naming the run's own file (the
segment in the run's pool, the snapshot's ``db/`` file a RocksDB read came from), never the
scratch store's link or copy of it.

``ServedTable.lookup`` returns the stored embedding columns only (the optimizer state behind
them is never kept): a set-associative LRU cache of ``cache_mb`` holds recently served rows, a
miss reads the owner rank's snapshot (key -> rank as in training: ``owner_rank``), and a key
stored nowhere gets its table's initializer value, as training would give it, without being
inserted anywhere.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading

import numpy as np

from ..cache.set_associative import SetAssociativeCache
from ..chain import open_store_for_snapshot
from ..errors import ConfigError, StoreError
from ..initializers import fill_initial_values
from ..parallel.shuffle import owner_rank
from ..store.durable import file_crc32


class SnapshotRows:
    """The rows of one rank's snapshot in ``folder`` (its manifest ``manifest``), read-only; the
    caller holds a lease on ``folder`` while this is open.

    stored_size: floats per stored line (line + lifecycle columns); scratch: a private folder
    for the store that reads an SSD snapshot."""

    def __init__(self, folder: str, manifest: dict, stored_size: int, scratch: str):
        self.folder, self.manifest, self.stored_size = folder, manifest, int(stored_size)
        self.scratch = scratch
        self._store = self._keys = self._lines = None
        self._damage: str | None = None  # what a check found after a failed read
        try:
            engine = manifest["engine"]
            if engine.endswith(".full"):
                self._keys = np.load(os.path.join(folder, "keys.npy"), mmap_mode="r")
                self._lines = np.load(os.path.join(folder, "lines.npy"), mmap_mode="r")
            else:
                self._store = open_store_for_snapshot(engine, self.stored_size, scratch)
                self._store.load_snapshot(folder)
        except BaseException:
            self.close()
            raise

    @property
    def store(self):
        """The private store reading an SSD snapshot (None for a memory store's snapshot)."""
        return self._store

    def pool_folder(self) -> str | None:
        """The slot segments' folder of a slots snapshot (the run's pool), else None."""
        try:
            with open(os.path.join(self.folder, "slots.json"), "rb") as f:
                return os.path.normpath(os.path.join(self.folder, json.loads(f.read())["pool"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def run_paths(self, message: str) -> str:
        """``message`` with the scratch store's files named as the run's own: its RocksDB's
        links to ``<folder>/db/``, its slot pool's view of the run's pool."""
        message = message.replace(os.path.join(self.scratch, "rocksdb") + os.sep,
                                  os.path.join(self.folder, "db") + os.sep)
        pool = self.pool_folder()
        if pool is not None:
            message = message.replace(os.path.join(self.scratch, "slots", "segments"), pool)
        return message.replace(self.scratch, self.folder)

    def _diagnose(self) -> str:
        """After a read failed without naming a file (RocksDB's "Blob CRC mismatch"): the first
        data file of the snapshot whose CRC32 differs from its manifest's, checked once."""
        if self._damage is None:
            self._damage = ""
            for rel, info in sorted(self.manifest.get("files", {}).items()):
                fpath = os.path.join(self.folder, *rel.split("/"))
                try:
                    bad = file_crc32(fpath) != info["crc32"]
                except OSError as e:
                    self._damage = f"; {fpath!r} is unreadable ({e.strerror or e})"
                    break
                if bad:
                    self._damage = f"; {fpath!r} fails its checksum (CRC32)"
                    break
        return self._damage

    def find(self, keys: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """keys (n,) uint64 -> lines into ``out[out_rows]`` (out: (N, stored_size)); returns the
        indices of the keys not stored (m,) int64. A damaged row raises StoreError naming the
        run's file."""
        if self._store is not None:
            try:
                return self._store.find(keys, out, out_rows)
            except StoreError as e:
                message = self.run_paths(str(e))
                named = (self.folder, self.pool_folder() or self.folder)
                if not any(where in message for where in named):  # RocksDB names no file
                    message += self._diagnose()
                raise StoreError(message) from None
        n = self._keys.shape[0]
        if n == 0:
            return np.arange(keys.shape[0], dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._keys, keys), n - 1)
        hit = np.asarray(self._keys[pos]) == keys
        found = np.flatnonzero(hit)
        order = np.argsort(pos[found], kind="stable")  # ascending offsets: sequential reads
        out[out_rows[found[order]]] = self._lines[pos[found[order]]]
        return np.flatnonzero(~hit)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        self._keys = self._lines = None


class ServedTable:
    """The snapshot's rows over all its ranks, with a RAM cache.

    sources: per rank, in rank order, (folder, manifest), each folder leased by the caller;
    layout: the embedding's ``LineLayout`` (its columns are served); tables: the embedding's
    ``TableOptions`` (their initializers give unknown keys their value); seed: the initializer
    seed; cache_mb: the cache's budget (0: no cache); snapshot: the name errors give."""

    def __init__(self, sources, layout, tables, seed: int, cache_mb: float = 64.0,
                 scratch: str | None = None, snapshot: str = ""):
        self.snapshot = snapshot
        self.layout, self.tables, self.seed = layout, tuple(tables), int(seed)
        self.dim = layout.embedding_dim
        manifest = sources[0][1]
        self.stored_size = int(manifest["line_size"]) + int(manifest.get("lifecycle_columns", 0))
        if scratch is not None:   # a folder named for the private stores is made if missing
            try:
                os.makedirs(scratch, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"scratch folder {scratch!r} cannot be made ({e}): give a "
                                  f"folder this process can write") from e
        self._scratch = tempfile.TemporaryDirectory(prefix="one_embedding_serve_", dir=scratch)
        self._lock = threading.Lock()
        self._ranks: list[SnapshotRows] = []
        try:
            for r, (folder, manifest) in enumerate(sources):
                sub = os.path.join(self._scratch.name, str(r))
                os.mkdir(sub)
                self._ranks.append(SnapshotRows(folder, manifest, self.stored_size, sub))
        except BaseException:
            self.close()
            raise
        rows = int(cache_mb * 2**20 // (4 * self.dim))
        self._cache = SetAssociativeCache(self.dim, rows, name="serve.lru") if rows >= 1 else None
        self.rows_stored = int(sum(m.get("row_count", 0) for _, m in sources))

    @property
    def world(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> list[SnapshotRows]:
        return list(self._ranks)

    def lookup(self, keys: np.ndarray, table_ids: np.ndarray) -> np.ndarray:
        """keys (n,) uint64, table_ids (n,) int32 -> (n, embedding_dim) float32: the stored
        embedding columns, or the initializer's value of a key stored nowhere. Thread-safe."""
        keys = np.ascontiguousarray(keys, np.uint64)
        uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        out = np.empty((uniq.shape[0], self.dim), np.float32)
        with self._lock:
            missing = np.arange(uniq.shape[0], dtype=np.int64)
            if self._cache is not None:
                missing = self._cache.find(uniq, out, missing)
            if missing.shape[0]:
                self._read_through(uniq, out, missing, table_ids[first])
        return out[inverse.reshape(-1)]

    def _read_through(self, uniq, out, missing, tables) -> None:
        """Rows of ``uniq[missing]`` from the ranks' snapshots into ``out`` (and the cache);
        initial values for the keys no snapshot holds."""
        keys = uniq[missing]
        lines = np.empty((keys.shape[0], self.stored_size), np.float32)
        owners = owner_rank(keys, self.world) if self.world > 1 else np.zeros(keys.shape[0], np.int64)
        found = np.ones(keys.shape[0], np.bool_)
        for r, rows in enumerate(self._ranks):
            mine = np.flatnonzero(owners == r)
            if mine.shape[0]:
                try:
                    found[mine[rows.find(keys[mine], lines, mine)]] = False
                except StoreError as e:
                    raise StoreError(f"serving snapshot {self.snapshot!r} ({rows.folder}): "
                                     f"{e}") from None
        hit = np.flatnonzero(found)
        out[missing[hit]] = lines[hit, :self.dim]
        if self._cache is not None and hit.shape[0]:
            self._cache.insert_or_assign(keys[hit], out[missing[hit]])  # evictions: dropped
        unknown = missing[~found]
        if unknown.shape[0]:
            self._initialize(out, unknown, uniq[unknown], tables[unknown])

    def _initialize(self, out, rows, keys, tables) -> None:
        """``out[rows]`` = the initial values of ``keys`` (their table's column initializers)."""
        for t in np.unique(tables):
            of_t = tables == t
            for (offset, dim), column in zip(self.layout.columns, self.tables[int(t)].columns):
                fill_initial_values(out, rows[of_t], keys[of_t], column.initializer, self.seed,
                                    offset, dim, offset)

    def close(self) -> None:
        for rows in self._ranks:
            rows.close()
        self._ranks = []
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
