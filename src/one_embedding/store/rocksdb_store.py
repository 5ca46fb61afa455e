"""The "rocksdb" SSD engine: lines in RocksDB through ``rocksdict``, no key index in RAM.

Keys are 8-byte big-endian uint64 (so RocksDB's byte order is the numeric order), values the raw
float32 bytes of a line, kept in blob files (BlobDB): the SSTs hold only keys and blob
references, so compaction rewrites little. Reads are batched multi-gets (``db.get(list)``,
which releases the GIL, split over two threads for big batches), with O_DIRECT where the file
system allows it; writes are one ``WriteBatch`` per call with the WAL off: the working DB is
scratch and durability comes from snapshots.

RAM per stored key is what RocksDB's table readers hold, ~1.3 bytes: every key is also written,
with an empty value, to a ``keys`` column family whose 10-bit bloom filters stay in RAM. A write
asks it which of its keys are there already (a multi-get its filters answer for new keys without
a disk read, and that never touches a value) for an exact row count; a read asks it first, so a
key never stored reads nothing and the rows' family needs no filter. The block cache (key blocks
of both families) is a fixed BLOCK_CACHE_MB.

Snapshots are incremental (``rocksdb_snapshots.py``): a RocksDB checkpoint whose SST and blob
files are hard links, reopened in place. Compaction is forced only when garbage has piled up
(``_reclaim``: past COMPACT_ABOVE times the live rows).

A failure of RocksDB (a full disk above all) in any of these steps is a StoreError that says
which path's disk is full and that the published snapshots are intact (``_io``); a DB a full
disk stopped is discarded by the next load of a snapshot.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from ..errors import StoreError
from ..tiers import StoreTier, empty_lines
from .direct_io import probe_direct_io
from .durable import no_space_left
from .rocksdb_snapshots import INFO_FILE, KEYS_CF, RocksDBSnapshots  # noqa: F401 - INFO_FILE: re-exported

DB_DIR = "rocksdb"
#: the most ``flush(wait_idle=True)`` waits for RocksDB's flushes and compactions to settle
IDLE_WAIT_SECONDS = 120.0
_PARALLEL_KEYS = 1 << 13
#: RocksDB's block cache (key blocks of both column families; rows are cached by the tiers
#: above): small and fixed, so the RAM a stored key costs is the table readers' alone
BLOCK_CACHE_MB = 8
#: the share of blob files, oldest first, whose live values a reclaiming save relocates
BLOB_GC_AGE_CUTOFF = 0.1
#: blob file size, the unit of garbage reclaim: about 1/64 of the table (``_size_blob_files``)
#: within these bounds (small files reclaim finely; every file costs RAM and a descriptor)
MIN_BLOB_FILE_MB, MAX_BLOB_FILE_MB = 8, 256
#: bytes a blob record adds to its value (key, header, checksum), for the live-size estimate
BLOB_RECORD_OVERHEAD = 40
#: SST bytes a stored key takes (internal key 8 + 8, blob index ~10, block overhead; in the rows'
#: column family and the keys' one), for the live size of ``space_amplification`` and the plan
KEY_SST_BYTES = 32
#: a save reclaims garbage first when the DB takes more than this many times its live rows ...
COMPACT_ABOVE = 1.25
#: ... and the excess is at least this many bytes (a tiny table's SST overheads are no garbage)
RECLAIM_MIN_BYTES = 8 << 20

log = logging.getLogger("one_embedding.store")


def _rocksdict():
    try:
        import rocksdict
    except ImportError:  # pragma: no cover - rocksdict is a dependency
        raise StoreError("the 'rocksdb' engine needs the rocksdict package: pip install rocksdict") from None
    return rocksdict


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """keys: (n,) uint64 -> n 8-byte big-endian byte strings."""
    raw = np.ascontiguousarray(keys, np.uint64).astype(">u8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def _keys_options(rd, direct: bool, cache):
    """The ``keys`` column family: keys with empty values, bloom-filtered, small blocks, in the
    rows' block cache (one budget for both)."""
    opts = rd.Options(raw_mode=True)
    opts.set_compression_type(rd.DBCompressionType.none())
    opts.set_write_buffer_size(16 << 20)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_use_direct_reads(direct)
    table = rd.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(cache)
    table.set_cache_index_and_filter_blocks(False)
    opts.set_block_based_table_factory(table)
    opts.set_memtable_whole_key_filtering(True)
    return opts


#: RocksDB's info LOG (one_embedding does not read it): rolled at this size, with
#: INFO_LOG_KEEP old ones kept; unbounded, it grew ~31 KB per snapshot for as long as a run went
INFO_LOG_BYTES = 1 << 20
INFO_LOG_KEEP = 2


def _db_options(rd, write_buffer_mb: int, cache, direct: bool):
    opts = rd.Options(raw_mode=True)
    opts.set_max_log_file_size(INFO_LOG_BYTES)
    opts.set_keep_log_file_num(INFO_LOG_KEEP)
    opts.create_missing_column_families(True)
    opts.create_if_missing(True)
    opts.set_compression_type(rd.DBCompressionType.none())
    opts.set_write_buffer_size(write_buffer_mb << 20)
    opts.set_max_write_buffer_number(3)
    opts.set_target_file_size_base(64 << 20)
    opts.set_max_background_jobs(2)
    opts.set_level_compaction_dynamic_level_bytes(True)
    # every line is overwritten again and again: merge L0 early so old versions do not pile up
    opts.set_level_zero_file_num_compaction_trigger(2)
    opts.set_use_direct_reads(direct)
    # no bloom filter here: a read asks the keys column family (filtered) first and reaches the
    # rows only for keys that are stored, where a filter would always say yes
    table = rd.BlockBasedOptions()  # 4 KiB blocks of keys and blob references
    table.set_block_cache(cache)
    table.set_cache_index_and_filter_blocks(False)
    opts.set_block_based_table_factory(table)
    # values in blob files (BlobDB): compaction then rewrites only the small key SSTs, so a
    # snapshot's links pin little that compaction replaces. Blob garbage is not relocated by
    # the background compactions (they would rewrite the oldest quarter of the table whatever
    # its garbage, and the snapshots would pin the old copy): a save reclaims it when the DB
    # has grown past COMPACT_ABOVE times its live rows (``_reclaim``)
    opts.set_enable_blob_files(True)
    opts.set_min_blob_size(0)
    opts.set_blob_file_size(MIN_BLOB_FILE_MB << 20)
    opts.set_blob_compression_type(rd.DBCompressionType.none())
    opts.set_enable_blob_gc(False)
    return opts


class RocksDBStore(RocksDBSnapshots, StoreTier):
    """Bottom tier on SSD: every key's line in the RocksDB at ``<directory>/rocksdb``."""

    def __init__(self, line_size: int, directory: str, threads: int = 2,
                 write_buffer_mb: int = 64, block_cache_mb: int = BLOCK_CACHE_MB,
                 name: str = "ssd.rocksdb",
                 direct_io: bool = True):
        self._rd = _rocksdict()
        self.line_size = int(line_size)
        self.name = name
        self._owner_pid = os.getpid()  # a forked child's copy closes nothing (close())
        self.threads = max(1, int(threads))
        self.path = os.path.join(directory, DB_DIR)
        self._write_options = self._rd.WriteOptions()
        self._write_options.disable_wal = True
        self._compact_options = self._rd.CompactOptions()
        self._compact_options.set_bottommost_level_compaction(
            self._rd.BottommostLevelCompaction.force())
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._db = None
        self._rows = 0
        self._blob_file_mb = MIN_BLOB_FILE_MB
        #: CRC32 of the data files of the last checkpoint, by identity (``_file_key``)
        self._crcs: dict[tuple, int] = {}
        try:
            os.makedirs(directory, exist_ok=True)
            # scratch state: whatever a killed process left here is discarded
            shutil.rmtree(self.path, ignore_errors=True)
            self.direct_io = bool(direct_io) and probe_direct_io(directory)
        except OSError as e:
            raise StoreError(
                f"cannot create the RocksDB folder under {directory!r} ({e.strerror or e}): "
                "give a persistent_path this process can write"
            ) from None
        cache = self._rd.Cache(block_cache_mb << 20)  # one budget for both column families
        self._options = _db_options(self._rd, write_buffer_mb, cache,
                                    self.direct_io)
        self._keys_options = _keys_options(self._rd, self.direct_io, cache)
        self._open()

    def _open(self) -> None:
        try:
            self._db = self._rd.Rdict(self.path, self._options,
                                      column_families={KEYS_CF: self._keys_options})
            self._keys = self._db.get_column_family(KEYS_CF)
            self._keys_handle = self._db.get_column_family_handle(KEYS_CF)
            self._blob_file_mb = MIN_BLOB_FILE_MB
            self._crcs = {}  # a new DB session: its file numbers may repeat an earlier one's
        except Exception as e:  # rocksdict raises plain Exception for I/O errors
            raise StoreError(f"{self.name}: cannot open RocksDB at {self.path!r}: {e}") from None

    def _close_db(self) -> None:
        """Close the working DB. The handles go even when closing fails (a DB stopped by a full
        disk refuses its last flush): the DB is scratch, rebuilt by the next open or load."""
        if self._db is not None:
            db, self._db = self._db, None
            self._keys = self._keys_handle = None
            try:
                db.close()
            except Exception as e:  # rocksdict raises plain Exception; nothing here is kept
                log.warning("%s: closing the working DB %r failed (%s); it is scratch and is "
                            "discarded", self.name, self.path, e)

    @contextlib.contextmanager
    def _io(self, doing: str, after: str = ""):
        """Turn a RocksDB failure (a plain Exception, or an OSError) while ``doing`` into a
        StoreError that says what failed, whether the disk is full, and that the published
        snapshots are intact (the working DB is scratch; snapshots are hard links RocksDB never
        writes into). ``after``: what the caller had completed already."""
        try:
            yield
        except StoreError:
            raise
        except Exception as e:  # rocksdict raises plain Exception for I/O errors
            what = f"the disk of {os.path.dirname(self.path)!r} is full" if no_space_left(e) else \
                "an I/O error stopped it"
            raise StoreError(
                f"{self.name}: {doing} in {self.path!r} failed: {what} ({e}). Every snapshot "
                f"already published is intact{after}: free disk space, then load the last "
                "snapshot (train --resume) to go on") from None

    def _int_property(self, name: str, both: bool = False) -> int:
        """A RocksDB integer property of the rows' column family (``both``: summed with the keys
        column family's)."""
        if self._db is None:
            raise StoreError(f"{self.name}: RocksDB property {name!r} read after close()")
        total = 0
        for table in (self._db, self._keys) if both else (self._db,):
            try:
                value = table.property_int_value(name)
            except Exception as e:  # rocksdict raises plain Exception (e.g. not an integer)
                raise StoreError(f"{self.name}: RocksDB property {name!r}: {e}") from e
            if value is None:
                raise StoreError(f"{self.name}: RocksDB has no integer property {name!r}")
            total += int(value)
        return total

    # -- Tier -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._rows

    @property
    def memory_bytes(self) -> int:
        """RocksDB's own RAM: table readers (index and filter blocks), memtables, block cache."""
        if self._db is None:
            return 0
        return sum(self._int_property(p, both=True) for p in (
            "rocksdb.estimate-table-readers-mem", "rocksdb.cur-size-all-mem-tables")) + \
            self._int_property("rocksdb.block-cache-usage")

    @property
    def disk_bytes(self) -> int:
        return tree_disk_bytes(self.path)

    def _size_blob_files(self) -> None:
        """New blob files of about 1/64 of the table (MIN..MAX_BLOB_FILE_MB): fine-grained
        reclaim for a small table, few files for a large one."""
        mb = self._rows * (4 * self.line_size + BLOB_RECORD_OVERHEAD) / 64 / 2**20
        mb = int(min(MAX_BLOB_FILE_MB, max(MIN_BLOB_FILE_MB, mb)))
        if mb != self._blob_file_mb:
            with self._io("resizing the blob files (RocksDB writes its OPTIONS file)"):
                self._db.set_options({"blob_file_size": str(mb << 20)})
            self._blob_file_mb = mb

    def flush(self, wait_idle: bool = False, idle_timeout: float = IDLE_WAIT_SECONDS) -> bool:
        """Write both column families' memtables to SSTs; ``wait_idle``: then wait until no
        flush or compaction runs (their writes and RAM have settled: what measurements want),
        at most ``idle_timeout`` seconds. Returns False when it stopped waiting with work still
        running (logged, with what ran), else True."""
        with self._io("flushing the memtables to SST files"):
            self._db.flush()
            self._keys.flush()
        if not wait_idle:
            return True
        busy = ("rocksdb.num-running-compactions", "rocksdb.num-running-flushes",
                "rocksdb.compaction-pending")
        deadline = time.monotonic() + idle_timeout
        while True:
            running = {p: self._int_property(p, both=True) for p in busy}
            if not any(running.values()):
                return True
            if time.monotonic() >= deadline:
                log.warning("%s: RocksDB still busy after %.0f s (%s); going on without waiting "
                            "for it", self.name, idle_timeout,
                            ", ".join(f"{p}={v}" for p, v in running.items() if v))
                return False
            time.sleep(0.02)

    def _reclaim(self, age_cutoff: float = BLOB_GC_AGE_CUTOFF, after: str = "") -> None:
        """Compact every key SST and relocate the live values of the oldest ``age_cutoff`` of
        blob files (those hold the most overwritten versions); blob files left with no live
        value are deleted. Costs at most that share of the table, once garbage has piled up to
        COMPACT_ABOVE times the live rows."""
        with self._io("reclaiming old row versions (blob garbage collection)", after):
            self._db.set_options({"enable_blob_garbage_collection": "true",
                                  "blob_garbage_collection_age_cutoff": str(age_cutoff)})
            try:
                self._db.compact_range(None, None, self._compact_options)
            except Exception:
                try:  # the compaction's error is the one to report
                    self._db.set_options({"enable_blob_garbage_collection": "false"})
                except Exception as e:
                    log.warning("%s: switching blob GC off after a failed compaction failed "
                                "too (%s)", self.name, e)
                raise
            self._db.set_options({"enable_blob_garbage_collection": "false"})

    def collect_garbage(self) -> int:
        """Reclaim what erased rows (an eviction sweep) left behind. The memtables are flushed
        and the compactions that triggers are waited for (they drop erased keys, and delete
        blob files left without a live value); then, once garbage passes COMPACT_ABOVE times
        the live rows and RECLAIM_MIN_BYTES, the oldest blob files are relocated, as many as
        the garbage's share of the DB, all of them once it is over half (erased rows are
        spread over every file). Returns 1 when it relocated, else 0. Files a snapshot links
        stay until it is deleted."""
        self.flush(wait_idle=True)  # the compactions the flush triggers settle first
        garbage, live = self._blob_garbage_bytes(), self._live_bytes()
        if not self._reclaim_due(garbage, live):
            return 0
        share = garbage / max(1, garbage + live)
        # more garbage than rows: relocating every live row costs less than it frees
        self._reclaim(1.0 if share > 0.5 else max(BLOB_GC_AGE_CUTOFF, share),
                      " (a save runs this after it has published its snapshot)")
        return 1

    @staticmethod
    def _reclaim_due(garbage: int, live: int) -> bool:
        """Whether ``garbage`` bytes beside ``live`` bytes of rows call for a reclaim: past
        COMPACT_ABOVE times the live rows and RECLAIM_MIN_BYTES (a save's and a GC's test)."""
        return garbage > max(RECLAIM_MIN_BYTES, (COMPACT_ABOVE - 1) * live)

    def _live_bytes(self) -> int:
        """What the live rows need in blob files."""
        return self._rows * (4 * self.line_size + BLOB_RECORD_OVERHEAD)

    def _blob_garbage_bytes(self) -> int:
        """Bytes of the blob files beyond what the live rows need: what relocating blob files
        (``_reclaim``) frees. The SSTs are left out: they hold every key's blob index (about
        KEY_SST_BYTES a key), which no reclaim frees, and counted as garbage they made every
        save of a table of short lines relocate the whole table (1.3x its size written after
        1 % of the rows changed, dim 16 SGD)."""
        return self._int_property("rocksdb.total-blob-file-size") - self._live_bytes()

    def space_amplification(self) -> float:
        """Bytes of the DB's SST and blob files over the bytes its live rows need (their
        values in blob files, their keys in SSTs): 1.0 for a table written once."""
        used = self._int_property("rocksdb.total-blob-file-size") + \
            self._int_property("rocksdb.live-sst-files-size", both=True)
        return used / max(1, self._live_bytes() + self._rows * KEY_SST_BYTES)

    def _multi_get(self, keys: np.ndarray, table=None) -> list:
        """keys: (n,) uint64 -> n values of ``table`` (default: the rows; bytes, or None where
        absent)."""
        n = keys.shape[0]
        if n == 0:
            return []
        get = (self._db if table is None else table).get
        kb = encode_keys(keys)
        try:
            if self._pool is None or n < _PARALLEL_KEYS:
                return get(kb)
            step = -(-n // self.threads)
            parts = self._pool.map(get, [kb[i:i + step] for i in range(0, n, step)])
            return [v for part in parts for v in part]
        except Exception as e:
            raise StoreError(f"{self.name}: multi-get of {n} keys failed: {e}") from None

    def _stored(self, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64 -> (n,) bool, held here (from the keys column family)."""
        return np.fromiter((v is not None for v in self._multi_get(keys, self._keys)), np.bool_,
                           keys.shape[0])

    def find(self, keys, out, out_rows):
        keys = np.ascontiguousarray(keys, np.uint64)
        found = self._stored(keys)  # new keys stop at the bloom filter: no disk read
        if found.any():
            out[np.asarray(out_rows)[found]] = self._lines_of(keys[found])
        return np.flatnonzero(~found)

    def _lines_of(self, keys: np.ndarray) -> np.ndarray:
        """keys: (n,) uint64 the keys family holds -> their lines (n, line_size) float32."""
        values = self._multi_get(keys)
        if any(v is None for v in values):
            raise StoreError(f"{self.name}: {self.path!r} lists keys without rows: the DB is "
                             "damaged; load another snapshot")
        return np.frombuffer(b"".join(values), np.float32).reshape(-1, self.line_size)

    def insert_or_assign(self, keys, lines):
        keys = np.ascontiguousarray(keys, np.uint64)
        n = keys.shape[0]
        if n:
            stored = self._stored(keys)
            new = int(n - stored.sum())
            raw = np.ascontiguousarray(lines, np.float32).tobytes()
            row = 4 * self.line_size
            batch = self._rd.WriteBatch(raw_mode=True)
            for i, k in enumerate(encode_keys(keys)):
                batch.put(k, raw[i * row:(i + 1) * row])
                if not stored[i]:
                    batch.put(k, b"", self._keys_handle)
            with self._io(f"writing {n} rows"):
                self._db.write(batch, self._write_options)
            self._rows += new
            self._size_blob_files()
        return empty_lines(self.line_size)

    def erase(self, keys: np.ndarray) -> int:
        """Delete keys (n,) uint64; returns how many were stored."""
        keys = np.ascontiguousarray(keys, np.uint64)
        held = [k for k, s in zip(encode_keys(keys), self._stored(keys)) if s]
        batch = self._rd.WriteBatch(raw_mode=True)
        for k in held:
            batch.delete(k)
            batch.delete(k, self._keys_handle)
        with self._io(f"erasing {len(held)} rows"):
            self._db.write(batch, self._write_options)
        self._rows -= len(held)
        return len(held)

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row in key order: the keys column family is iterated (small, sequential) and
        each batch's lines come from one multi-get (RocksDB sorts its blob reads by file and
        offset; iterating the rows themselves reads blob after blob, ~15x slower here). An
        iterator that stops on an error raises, never ends early."""
        it = self._keys.iter()
        it.seek_to_first()
        while True:
            raw = []
            while it.valid() and len(raw) < batch_rows:
                raw.append(it.key())
                it.next()
            if not it.valid():
                try:
                    it.status()
                except Exception as e:
                    raise StoreError(f"{self.name}: reading {self.path!r} failed: {e}; load "
                                     "another snapshot") from None
            if raw:
                keys = np.frombuffer(b"".join(raw), ">u8").astype(np.uint64)
                yield keys, self._lines_of(keys).copy()
            if not it.valid():
                return

    def clear(self) -> None:
        self._close_db()
        shutil.rmtree(self.path, ignore_errors=True)
        self._rows = 0
        self._open()

    def close(self) -> None:
        """Close the DB and delete its folder: it is scratch (discarded by the next open
        anyway); SSTs a snapshot links stay there. Nothing in a process forked from the owner
        (its DB, still in use there: closing it hung on RocksDB's threads, which a fork does
        not copy, and the folder would have been deleted under the owner)."""
        if os.getpid() != getattr(self, "_owner_pid", os.getpid()):
            return
        self._close_db()
        shutil.rmtree(self.path, ignore_errors=True)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __del__(self):
        if getattr(self, "_db", None) is None:   # closed, or never opened
            return
        if os.getpid() != getattr(self, "_owner_pid", None):  # a forked child's copy
            return
        try:
            self.close()
        except Exception as e:  # garbage collection cannot raise: the reason is logged
            log.warning("%s was not closed, and closing it at garbage collection failed: %r",
                        self.name, e)


def tree_disk_bytes(path: str) -> int:
    """Bytes allocated under ``path``, each hard-linked inode counted once."""
    seen = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for fname in files:
            try:
                st = os.lstat(os.path.join(root, fname))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
