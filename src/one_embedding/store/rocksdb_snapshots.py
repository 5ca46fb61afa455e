"""The RocksDB engine's snapshots (``RocksDBStore`` inherits them): incremental, by hard links.

Saving flushes both memtables, then writes a RocksDB checkpoint into ``<snapshot>/db/``: the SST
and blob files are hard links (RocksDB never writes into one after creating it, and deletes it
only by name, so the inode stays valid while any snapshot or working DB links it); the small
metadata files are copies. The CRC32 of each data file is computed once per file identity (new
files only: ``_data_file_crc``) and recorded in the manifest as a shared file; ``rocksdb.json``
lists every file of ``db/`` with its size. Garbage is reclaimed first only when it has piled up
(the store's ``_reclaim_due``). Loading (reopen in place) rebuilds the working DB from hard links
to the snapshot's data files and copies of its metadata (a copy where the file system cannot
link). Deleting a snapshot removes its links; a file goes when its last link does: disk is
reclaimed without a collector of our own.

``rocksdb.json`` records the layout's ``format``: 2 is the current one (the rows in the default
column family, every stored key also in the ``keys`` column family, which gates reads). A file
without the field was written either by a version of that layout from before the field, or by
one from before the ``keys`` column family (format 1: the rows alone); the DB's column families
tell them apart. A format-1 snapshot is migrated as it loads: the working DB's ``keys`` family
is rebuilt from the stored rows (the snapshot's own files are never written). A newer format is
refused, and so is a snapshot without the field whose ``keys`` family disagrees with its row
count (an older version wrote rows into a current-layout DB without listing their keys).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil

from ..errors import SnapshotError, StoreError
from .durable import (copy_file, file_crc32, fsync_dir, fsync_path, no_space_left,
                      write_bytes_atomic)
from .snapshots import NewerFormatError, read_manifest

INFO_FILE = "rocksdb.json"
#: the layout ``rocksdb.json`` records as ``format``: 1 = rows only (before the keys column
#: family; never written with the field), 2 = rows + the keys column family
ROCKSDB_FORMAT = 2
#: the column family of the stored keys (empty values) in format 2
KEYS_CF = "keys"
_REBUILD_BATCH = 1 << 16

log = logging.getLogger("one_embedding.store")
#: the immutable data files of a DB (shared by hard links); the rest are small metadata copies
_SHARED_SUFFIXES = (".sst", ".blob")


class RocksDBSnapshots:
    """Snapshot methods of ``RocksDBStore`` (it provides the working DB and its path, the
    flush, the garbage reclaim, the I/O error wrapper and the CRC32 cache ``_crcs``)."""

    @staticmethod
    def _file_key(path: str) -> tuple:
        """The identity of a data file: (device, inode, name, size, mtime_ns). RocksDB never
        writes into a finished file, so this names its content, where the inode alone does not:
        a deleted file's inode is reused by the next file created, which may have its size.
        Within one DB session RocksDB never reuses a file name (a new session, ``_open``,
        forgets every CRC). ctime is left out: every checkpoint's hard link changes it.

        rocksdict (0.3) exposes neither RocksDB's own file checksums (no
        ``file_checksum_gen_factory``, no checksums in ``live_files``) nor a way to verify
        them, so the CRC32s are ours, computed once per file identity."""
        st = os.stat(path)
        return st.st_dev, st.st_ino, os.path.basename(path), st.st_size, st.st_mtime_ns

    def _data_file_crc(self, path: str, seen: dict | None = None) -> int:
        """CRC32 of an SST or blob file, computed once per file identity (``_file_key``);
        ``seen``: collects this save's entries (the cache keeps only those afterwards)."""
        key = self._file_key(path)
        crc = self._crcs.get(key)
        if crc is None:
            crc = file_crc32(path)
            self._crcs[key] = crc
        if seen is not None:
            seen[key] = crc
        return crc

    def save_snapshot(self, directory: str) -> dict:
        """Write ``db/`` (a RocksDB checkpoint: SSTs hard-linked, metadata copied) and
        ``rocksdb.json`` into ``directory``; returns the SSTs' sizes and CRC32s (shared files)."""
        target = os.path.join(directory, "db")
        self._size_blob_files()
        self.flush()  # the WAL is off: the memtables must reach SSTs first
        if self._reclaim_due(self._blob_garbage_bytes(), self._live_bytes()):
            self._reclaim()
        with self._io(f"a RocksDB checkpoint into {target!r}"):
            self._rd.Checkpoint(self._db).create_checkpoint(target)
        try:
            files, shared, seen = {}, {}, {}
            for entry in sorted(os.listdir(target)):
                path = os.path.join(target, entry)
                files[entry] = os.path.getsize(path)
                if entry.endswith(_SHARED_SUFFIXES):
                    shared[f"db/{entry}"] = {"bytes": files[entry],
                                             "crc32": self._data_file_crc(path, seen)}
                else:
                    fsync_path(path)
            self._crcs = seen  # this checkpoint's files only: a file the next save links and
            # this one did not is new (computed then), so nothing else is needed
            fsync_dir(target)
            write_bytes_atomic(os.path.join(directory, INFO_FILE), json.dumps(
                {"engine": "rocksdb", "format": ROCKSDB_FORMAT, "line_size": self.line_size,
                 "rows": self._rows, "db_files": files}).encode())
        except OSError as e:
            what = "the disk is full" if no_space_left(e) else "an I/O error stopped it"
            raise StoreError(
                f"{self.name}: writing snapshot files into {directory!r} failed: {what} "
                f"({e.strerror or e}); free disk space and save again. Every snapshot already "
                "published (the previous one of that name included) is intact"
            ) from None
        return shared

    def _read_info(self, directory: str) -> dict:
        try:
            with open(os.path.join(directory, INFO_FILE), "rb") as f:
                info = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise SnapshotError(f"{self.name}: snapshot {directory!r} is unreadable: {e}") from None
        db_files = info.get("db_files") if isinstance(info, dict) else None
        if not isinstance(db_files, dict) or not db_files or info.get("engine") != "rocksdb" \
                or info.get("line_size") != self.line_size or not isinstance(info.get("rows"), int):
            raise SnapshotError(
                f"{self.name}: snapshot {directory!r} holds {info}; this store needs a 'rocksdb' "
                f"snapshot of line_size={self.line_size}")
        fmt = info.get("format")
        if fmt is not None and (not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 2):
            raise SnapshotError(
                f"{self.name}: snapshot {directory!r} is damaged: {INFO_FILE} records format "
                f"{fmt!r}, which no one_embedding writes; load another snapshot")
        if fmt is not None and fmt > ROCKSDB_FORMAT:
            raise NewerFormatError(
                f"{self.name}: rocksdb snapshot {directory!r} was written by a newer "
                f"one_embedding (rocksdb format {fmt}; this version reads up to "
                f"{ROCKSDB_FORMAT}): upgrade one_embedding to read it")
        for entry, size in db_files.items():
            fpath = os.path.join(directory, "db", entry)
            if os.path.basename(entry) != entry or not os.path.isfile(fpath) \
                    or os.path.getsize(fpath) != size:
                raise SnapshotError(
                    f"{self.name}: snapshot {directory!r} is damaged: db/{entry} is missing or not "
                    f"{size} bytes; load another snapshot")
        return info

    def load_snapshot(self, directory: str) -> None:
        """Rebuild the working DB from the snapshot's ``db/`` files (exactly those that
        ``rocksdb.json`` lists): SSTs hard-linked, the rest copied."""
        info = self._read_info(directory)
        source = os.path.join(directory, "db")
        self._close_db()
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.mkdir(self.path)
            for entry in info["db_files"]:
                src, dst = os.path.join(source, entry), os.path.join(self.path, entry)
                if entry.endswith(_SHARED_SUFFIXES):
                    _link_or_copy(src, dst)
                else:
                    copy_file(src, dst)
        except OSError as e:
            raise StoreError(f"{self.name}: restoring {source!r} into {self.path!r} failed: {e}") from None
        try:
            families = self._rd.Rdict.list_cf(self.path)
        except Exception as e:  # rocksdict raises plain Exception for a bad MANIFEST
            raise SnapshotError(f"{self.name}: snapshot {directory!r} is damaged: its RocksDB "
                                f"column families cannot be read ({e}); load another snapshot") from None
        self._open()  # adds an empty keys family to a format-1 DB (the working copy only)
        rows = int(info["rows"])
        fmt = info.get("format")
        if KEYS_CF not in families:
            if fmt is not None:
                raise SnapshotError(
                    f"{self.name}: snapshot {directory!r} is damaged: {INFO_FILE} records format "
                    f"{fmt} but its DB has no {KEYS_CF!r} column family; load another snapshot")
            counted = self._rebuild_keys(directory)
            if counted != rows:
                log.warning("%s: snapshot %r records %d rows, its DB holds %d: counting these",
                            self.name, directory, rows, counted)
            log.info("%s: snapshot %r was written by an older one_embedding (rocksdb format 1, "
                     "no %r column family); its %d keys were listed in the working DB (the "
                     "snapshot is unchanged; the next save writes format %d)", self.name,
                     directory, KEYS_CF, counted, ROCKSDB_FORMAT)
            rows = counted
        elif fmt is None:
            listed = self._count_keys()
            if listed != rows:
                raise SnapshotError(
                    f"{self.name}: rocksdb snapshot {directory!r} records {rows} rows but its "
                    f"{KEYS_CF!r} column family lists {listed} keys, and {INFO_FILE} has no "
                    "format field: an older one_embedding (from before the keys column family) "
                    "wrote rows into a DB of this layout without listing their keys, so this "
                    "version cannot read it reliably; load a snapshot this version wrote, or "
                    "read this one with the version that saved it")
        self._rows = rows
        self._remember_checksums(directory)

    def _count_keys(self) -> int:
        """How many keys the working DB's keys column family lists (iterated: no estimate)."""
        it = self._keys.iter()
        it.seek_to_first()
        n = 0
        while it.valid():
            n += 1
            it.next()
        self._iter_status(it)
        return n

    def _iter_status(self, it) -> None:
        try:
            it.status()
        except Exception as e:  # rocksdict raises plain Exception
            raise StoreError(f"{self.name}: reading {self.path!r} failed: {e}; load another "
                             "snapshot") from None

    def _rebuild_keys(self, directory: str) -> int:
        """Format 1 -> 2 in the working DB: put every key of the rows' column family into the
        (new, empty) keys column family. Returns how many."""
        it = self._db.iter()
        it.seek_to_first()
        n = 0
        while True:
            batch, count = self._rd.WriteBatch(raw_mode=True), 0
            while it.valid() and count < _REBUILD_BATCH:
                key = it.key()
                if len(key) != 8:
                    raise SnapshotError(
                        f"{self.name}: snapshot {directory!r} holds a key of {len(key)} bytes "
                        "(8 expected): it is not a table of this engine; load another snapshot")
                batch.put(key, b"", self._keys_handle)
                count += 1
                it.next()
            if count:
                with self._io(f"listing {count} keys of an older snapshot"):
                    self._db.write(batch, self._write_options)
                n += count
            if not it.valid():
                self._iter_status(it)
                return n

    def _remember_checksums(self, directory: str) -> None:
        """Take the CRC32s the snapshot's manifest records of its SSTs (the working DB links the
        same inodes), so the next save reads none of them again."""
        try:
            files = read_manifest(directory, os.path.basename(directory))["files"]
        except (SnapshotError, KeyError, TypeError):
            return  # a bare snapshot folder (no manifest): the next save computes them
        for rel, entry in files.items():
            if rel.startswith("db/") and rel.endswith(_SHARED_SUFFIXES):
                try:
                    key = self._file_key(os.path.join(directory, rel))
                except OSError:
                    continue
                if key[3] == entry.get("bytes"):
                    self._crcs[key] = int(entry["crc32"])


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        copy_file(src, dst)
