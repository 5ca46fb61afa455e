"""The "slots" SSD engine: a log of immutable segments on disk, a 5-byte-a-key directory in RAM.

Rows (whole lines: embedding + optimizer state) are appended to the *active* segment
(``segments.py``) in whole blocks with O_DIRECT; a row is never updated in place, so a write
costs one sequential block write per ``rows_per_block`` rows and no read-modify-write. The RAM
holds a ``CompactIndex`` (an 8-bit tag and a 32-bit location per key, ~5.4-6.8 bytes a key) and
per-segment counters; the keys themselves are on disk, in each segment's key file, read through
the page cache to confirm tag matches. A lookup of a key that was never stored matches no tag
~97 % of the time and then reads nothing at all.

- A read resolves the keys to locations, reads each distinct block once (runs of adjacent
  blocks in one call, ``io_threads`` requests in flight, across segment files) and a numba
  kernel copies the rows out (the block reads and writes: ``slot_block_io.py``).
- A write appends, then points the directory at the new rows; the old rows become garbage.
- Compaction: when garbage passes ``garbage_ratio`` of the live segments' slots, the sealed
  segments with the least live rows have those rows appended again and leave the live table.
- Snapshots (``save_snapshot``): the active segment is sealed (its rows synced, its keys
  written) and ``slots.json`` lists the live segments with their sizes and CRC32s. That costs
  the rows written since the last snapshot (the caches' flush) plus a key file and a list: not
  a copy of the table. Segments are shared by the live table and any number of snapshots.
- Loading (``load_snapshot``) opens the listed segments where they are and rebuilds the
  directory from their key files (8 bytes a row read, nothing written): reopening a TB table
  costs its directory, not its rows.
- Garbage collection (``collect_garbage``) deletes the segment files that neither the live
  table nor any folder under ``<directory>/snapshots/`` (published, being written, or deleted
  but leased by a reader) refers to. A killed process leaves only unreferenced segments
  behind (everything after its last snapshot), which the next open collects.

A full disk (ENOSPC, EDQUOT) on any write (a new segment's preallocation of its rows and keys,
a seal's checksum and tombstone files, slots.json, a compaction's appends) is a StoreError that
names the path, says the disk is full and the published snapshots are intact; the live table
stays as it was before the failed call (the rows of a failed write are garbage no key points
at), so once space is free the run saves again or loads any snapshot in the same process.

Snapshots of this engine live under ``<directory>/snapshots/``, where garbage collection sees
them (``slot_snapshots.py``). A snapshot written by the earlier format (``keys.npy``,
``slots.npy``, ``rows.bin``) still loads; its rows are copied into segments.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from ..errors import StoreError
from ..tiers import StoreTier, empty_lines
from ..tiers.compact_index import MAX_LOCATION, CompactIndex
from . import segments as seg_files
from .direct_io import AlignedBuffer, IOPool
from .durable import write_failed
from .segments import SegmentPool, block_layout, default_segment_rows
from .slot_block_io import IO_CHUNK_BYTES, SlotBlockIO
from .slot_snapshots import SlotSnapshots
from .snapshots import SnapshotDirectory

log = logging.getLogger(__name__)

__all__ = ["SlotFileStore", "block_layout"]

# IO_CHUNK_BYTES (the staging buffers) lives in slot_block_io; plan.py reads it from here

#: compaction starts when garbage passes this share of the live segments' slots ...
GARBAGE_RATIO = 0.3
#: ... and stops below this share
GARBAGE_TARGET = 0.2
#: sealed segments under a quarter of ``segment_rows`` kept before the smallest are merged
SMALL_SEGMENTS = 32
_MAX_INITIAL_KEYS = 1 << 20



class SlotFileStore(SlotBlockIO, SlotSnapshots, StoreTier):
    """Bottom tier on SSD: every key's line in the segments under ``<directory>/slots/``.

    threads: CPU threads of the row copies between the staging buffers and the caller's lines;
    io_threads: block reads / writes in flight (the disk needs ~16 to reach its random-read
    rate); direct_io: read and write with O_DIRECT (a filesystem that refuses it, such as tmpfs
    before Linux 6.6, falls back to buffered I/O with one warning; False: buffered, no warning);
    segment_rows: slots a segment holds (default ~64 MiB of rows, a power of two);
    garbage_ratio: the share of dead rows in the live segments that starts a compaction.
    """

    def __init__(self, line_size: int, directory: str, physical_block_size: int = 4096,
                 expected_keys: int = 0, threads: int = 2, name: str = "ssd.slots",
                 io_threads: int = 16, direct_io: bool = True, segment_rows: int | None = None,
                 garbage_ratio: float = GARBAGE_RATIO):
        self.line_size = int(line_size)
        self.name = name
        self._owner_pid = os.getpid()  # a forked child's copy closes nothing (close())
        self.threads = max(1, int(threads))
        self.directory = directory
        self.physical_block_size = physical_block_size
        self.garbage_ratio = float(garbage_ratio)
        rows = int(segment_rows) if segment_rows else default_segment_rows(self.line_size)
        try:
            self.pool = SegmentPool(os.path.join(directory, "slots", "segments"), self.line_size,
                                    physical_block_size, rows, direct_io)
        except OSError as e:
            raise StoreError(
                f"cannot create the slot folder under {directory!r} ({e.strerror or e}): "
                "give a persistent_path this process can write"
            ) from None
        self._snapshots = SnapshotDirectory(directory, create=False)
        self._index = CompactIndex(min(int(expected_keys or 0), _MAX_INITIAL_KEYS))
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._io = IOPool(io_threads)
        self._read_buffer = AlignedBuffer(IO_CHUNK_BYTES)
        self._write_buffer = AlignedBuffer(IO_CHUNK_BYTES)
        self._segments: dict = {}      # directory index -> Segment of the live table
        self._free_indices: list[int] = []
        self._active = None            # the segment being appended to (None until a write)
        self._slots_total = 0          # slots of every live segment, garbage included
        self._legacy = None            # index -> legacy block checksums?, rebuilt on changes
        self._broken = None            # why the live table can no longer be trusted
        #: an erase an interrupt stopped: (segment, tombstones before, tombstones, keys,
        #: locations), finished by ``_settle`` (``_unsettled``: the same for a block write)
        self._pending_erase = None
        #: the locations (n,) int64 of an insert's rows (-1: not placed yet) until the
        #: directory points at them: an interrupt between the two is finished by ``_settle``
        self._pending_upsert = None
        #: blocks read by finds, blocks written, rows copied by compaction, segments deleted
        self.io_counts = {"read_blocks": 0, "written_blocks": 0, "compacted_rows": 0,
                          "compactions": 0, "deleted_segments": 0}
        #: wall seconds spent waiting for block reads (their rate: read_blocks / read_seconds)
        self.read_seconds = 0.0
        self._next_id = 1 + max(self.pool.ids_on_disk() | self._pinned_ids(), default=0)
        self.collect_garbage()  # a killed process's segments after its last snapshot

    # -- properties ---------------------------------------------------------------------------
    @property
    def rows_per_block(self) -> int:
        return self.pool.rows_per_block

    @property
    def block_bytes(self) -> int:
        return self.pool.block_bytes

    @property
    def segment_rows(self) -> int:
        return self.pool.segment_rows

    @property
    def direct_io(self) -> bool:
        """Whether segments are read and written with O_DIRECT (False after the fallback)."""
        return self.pool.direct

    @property
    def io_threads(self) -> int:
        """Block reads / writes in flight; settable (1: no I/O threads)."""
        return self._io.io_threads

    @io_threads.setter
    def io_threads(self, value: int) -> None:
        self._io.set_io_threads(value)

    def _check(self) -> None:
        if self._broken is not None:
            raise StoreError(f"{self.name}: {self._broken}")

    # -- locations ------------------------------------------------------------------------
    def _split(self, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """locations (n,) int64 -> (segment index, slot), each (n,) int64."""
        seg = locs // self.pool.segment_rows
        return seg, locs - seg * self.pool.segment_rows

    def _keys_of(self, locs: np.ndarray) -> np.ndarray:
        """locations (n,) int64 -> their keys (n,) uint64, from the segments' key files."""
        return self._per_segment("keys", *self._split(locs))

    def _per_segment(self, field: str, seg: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """seg, idx: (n,) int64 -> (n,) uint64: each live segment's ``field`` ("keys" per slot,
        "sums" per block) at ``idx``, gathered one segment at a time."""
        out = np.empty(seg.shape[0], np.uint64)
        if seg.shape[0] == 0:
            return out
        first = int(seg[0])
        if (seg == first).all():
            out[:] = getattr(self._segments[first], field)[idx]
            return out
        order = np.argsort(seg, kind="stable")
        sorted_seg = seg[order]
        cuts = np.flatnonzero(sorted_seg[1:] != sorted_seg[:-1]) + 1
        for part in np.split(order, cuts):
            out[part] = getattr(self._segments[int(seg[part[0]])], field)[idx[part]]
        return out

    def _take_index(self) -> int:
        """A directory index no live segment holds (the free list is a hint: an interrupt may
        leave one there twice, or one that a live segment holds)."""
        while self._free_indices:
            index = self._free_indices.pop()
            if index not in self._segments:
                return index
        index = len(self._segments)
        while index in self._segments:  # an index an interrupt kept off the free list
            index += 1
        if (index + 1) * self.pool.segment_rows - 1 > MAX_LOCATION:
            raise StoreError(f"{self.name}: {index} live segments of {self.pool.segment_rows} rows "
                             "fill the 32-bit location space of the directory")
        return index

    # -- appends and the live segments --------------------------------------------------------
    def _append(self, keys: np.ndarray, lines: np.ndarray,
                locs: np.ndarray | None = None) -> np.ndarray:
        """Append rows (keys (n,) uint64, lines (n, line_size) float32) to the active segment,
        sealing it and starting another when it is full. Returns their locations (n,) int64
        (``locs``, if given, is filled: each row's before it is written). The directory is not
        touched."""
        n = keys.shape[0]
        if locs is None:
            locs = np.empty(n, np.int64)
        done = 0
        while done < n:
            seg = self._writable_active(settle=False)
            if seg is None:
                seg = self._new_segment()
            take = min(seg.capacity - seg.n_slots, n - done)
            if take == 0:
                self._seal_active(settle=False)
                continue
            start = seg.n_slots
            locs[done:done + take] = seg.base + np.arange(start, start + take)
            self._write_into(seg, keys[done:done + take], lines[done:done + take])
            done += take
        return locs

    def _new_segment(self):
        """The next active segment. Its capacity follows the table (an eighth of the rows held,
        a power of two from 1024 up to ``segment_rows``), so a small table's garbage, which
        stays in the active segment until it is sealed, stays small too."""
        index = self._take_index()
        want = max(1024, len(self._index) // 8)
        capacity = min(self.pool.segment_rows, 1 << (want - 1).bit_length())
        # the id is used up before its files may exist: an interrupt anywhere below never makes
        # the next segment ask for a name that is taken (its files, if any, go at the next GC)
        seg_id = self._next_id
        self._next_id = seg_id + 1
        try:
            seg = self.pool.create(seg_id, index, capacity)
        except BaseException:
            self._free_indices.append(index)  # (only a hint: _take_index checks it)
            raise
        # active first: an active segment outside the live table is dropped (_writable_active),
        # a live unsealed one that is not active would have no info to save
        self._active = seg
        self._add(seg)
        return seg

    def _writable_active(self, settle: bool = True):
        """The active segment, or None: what an interrupt left half done is finished first (a
        seal whose files are written is completed; a segment that is not in the live table, or
        no longer, is dropped)."""
        if settle:
            self._settle()
        seg = self._active
        if seg is None:
            return None
        if self._segments.get(seg.index) is not seg:
            self._drop_stray_active(seg)
            return None
        if seg.info is not None:  # sealed on disk: no row may go there any more
            self._seal_active(settle=settle)
            return None
        return seg

    def _drop_stray_active(self, seg) -> None:
        """``seg`` is active but not in the live table (an interrupt between the two steps of
        making or forgetting it): it holds no row a key points at; closed (again: idempotent),
        its files go at the next GC."""
        self._active = None
        seg.close()

    def _add(self, seg) -> None:
        self._segments[seg.index] = seg
        self._slots_total += seg.n_slots
        self._legacy = None

    def _seal_active(self, settle: bool = True) -> None:
        """Seal the active segment (an empty one just leaves). It stays the active one until
        the seal is complete: whatever stops it (a full disk, a KeyboardInterrupt), the next
        save (or write) seals it again, or finishes the seal (``SegmentPool.seal``)."""
        if settle:
            self._settle()
        seg = self._active
        if seg is None:
            return
        if self._segments.get(seg.index) is not seg:  # an interrupted _forget / _new_segment
            self._drop_stray_active(seg)
            return
        if seg.info is None and seg.n_slots == 0 and not seg.dead:
            self._forget(seg)
            self._active = None
            return
        try:
            self.pool.seal(seg)
        except OSError as e:  # still active and whole: sealed again by the next save
            raise StoreError(f"{self.name}: " + write_failed(
                "sealing the segment", seg.path("rows"), e, "save again")) from None
        self._active = None

    def _forget(self, seg) -> None:
        """Take ``seg`` out of the live table and close it (its files stay until GC). Leaving
        the live table is the first step: an interrupt after it costs a directory index at
        most (``_take_index`` does not trust the free list)."""
        self._pending_upsert = None  # (its locations may name this segment's index again)
        del self._segments[seg.index]
        self._slots_total -= seg.n_slots
        self._free_indices.append(seg.index)
        self._legacy = None
        seg.close()

    def _settle(self) -> None:
        """Finish what an interrupt stopped: a block write (``_settle_write``), then an erase
        (``_finish_erase``). Every write, erase, seal and save calls it first."""
        self._settle_write()
        if self._pending_upsert is not None:
            self._finish_upsert()
        if self._pending_erase is not None:
            self._finish_erase()

    def _finish_upsert(self, keys: np.ndarray | None = None,
                       locs: np.ndarray | None = None) -> None:
        """Point the directory at the rows ``locs`` of an insert (default: the one recorded in
        ``_pending_upsert``); ``keys``: theirs; None: an interrupt stopped the insert, so the
        rows written, those below their segment's slot count, are taken with their keys from
        the key files. Safe to run again: the same keys at the same locations."""
        if locs is None:
            locs = self._pending_upsert
        if keys is None:
            seg, slot = self._split(locs)
            ok = locs >= 0
            for index in np.unique(seg[ok]).tolist():
                s = self._segments.get(index)
                written = 0 if s is None else s.n_slots
                ok &= (seg != index) | (slot < written)
            locs = locs[ok]
            keys = self._keys_of(locs)
        old = self._index.upsert(keys, locs, self._keys_of)
        self._count_live(locs, 1)
        self._count_live(old[old >= 0], -1)
        self._pending_upsert = None

    def _finish_erase(self) -> None:
        """Complete the erase recorded in ``_pending_erase``, each step once whatever stopped an
        earlier run: the tombstones go into the active segment first (the snapshot replay erases
        the keys), then the entries that still hold the erased locations leave the directory."""
        pending = self._pending_erase
        seg, n_dead, tombstones, keys, locs = pending
        if self._segments.get(seg.index) is seg and seg.info is None and not seg.sealed:
            if len(seg.dead) == n_dead:  # (a list's extend by a list is one step)
                seg.dead.extend(tombstones)
            pos = self._index.positions_of_locations(keys, locs)
            held = pos >= 0
            self._index.erase_at(pos)
            self._count_live(locs[held], -1)
        self._pending_erase = None

    def _count_live(self, locs: np.ndarray, step: int) -> None:
        if locs.shape[0] == 0:
            return
        seg, _ = self._split(locs)
        idx, counts = np.unique(seg, return_counts=True)
        for i, c in zip(idx.tolist(), counts.tolist()):
            self._segments[i].live += step * c

    # -- Tier -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    @property
    def memory_bytes(self) -> int:
        """The directory, the active segment's block checksums and the staging buffers (keys
        are read from their files through the page cache)."""
        active_sums = 0 if self._active is None else self._active.sums.nbytes
        return (self._index.nbytes + active_sums + self._read_buffer.nbytes
                + self._write_buffer.nbytes + 64 * len(self._segments))

    @property
    def disk_bytes(self) -> int:
        """Bytes the live table's segment files take on disk (``describe`` adds what only
        snapshots still hold)."""
        return sum(_allocated(self.pool.path(s.id, k)) for s in self._segments.values()
                   if s.owned for k in seg_files.KINDS)

    def describe(self) -> dict:
        pool_bytes = sum(_allocated(os.path.join(self.pool.folder, e))
                         for e in os.listdir(self.pool.folder))
        disk = self.disk_bytes
        return {**super().describe(), "direct_io": self.direct_io, **self.io_counts,
                "read_seconds": round(self.read_seconds, 6),
                "segments": len(self._segments), "slots_total": self._slots_total,
                "garbage_rows": self._slots_total - len(self._index),
                "pinned_disk_bytes": max(0, pool_bytes - disk)}

    def find(self, keys, out, out_rows):
        keys = np.ascontiguousarray(keys, np.uint64)
        locs = self._index.find(keys, self._keys_of)
        found = locs >= 0
        self.read_locations(locs[found], out, np.asarray(out_rows)[found])
        return np.flatnonzero(~found)

    def insert_or_assign(self, keys, lines):
        self._check()
        keys = np.ascontiguousarray(keys, np.uint64)
        lines = np.ascontiguousarray(lines, np.float32)
        self._settle()
        if keys.shape[0] == 0:
            return empty_lines(self.line_size)
        # the rows, then the directory; an interrupt between: the record finishes the insert
        locs = np.full(keys.shape[0], -1, np.int64)
        self._pending_upsert = locs
        try:
            self._append(keys, lines, locs)
        except StoreError:  # a full disk: the directory untouched, the rows are garbage
            self._pending_upsert = None
            raise
        self._finish_upsert(keys, locs)
        self._maybe_compact()
        return empty_lines(self.line_size)

    def erase(self, keys: np.ndarray) -> int:
        """Delete keys (n,) uint64 (absent ones are ignored); returns how many were stored. A
        tombstone in the active segment keeps an older segment from bringing them back when a
        snapshot is replayed."""
        self._check()
        keys = np.ascontiguousarray(keys, np.uint64)
        active = self._writable_active()  # (finishes what an interrupt stopped)
        pos = self._index.positions(keys, self._keys_of)
        held = pos >= 0
        if not held.any():
            return 0
        if active is None:  # first: a full disk fails here, before a key goes
            active = self._new_segment()
        gone = keys[held]
        at = active.n_slots
        # one record, then its steps (``_finish_erase``): an interrupt anywhere leaves the erase
        # undone (no record yet) or recorded, finished by the next call (a snapshot included)
        self._pending_erase = (active, len(active.dead), [(k, at) for k in gone.tolist()],
                               gone, self._index.locations_at(pos[held]))
        self._finish_erase()
        self._maybe_compact()
        return int(held.sum())

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._settle()
        locs = self._index.locations()
        keys = self._keys_of(locs)
        order = np.argsort(keys, kind="stable")
        keys, locs = keys[order], locs[order]
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self.read_locations(locs[start:stop])

    def clear(self) -> None:
        """Drop every row: the live table becomes empty (its segments go at the next GC). The
        directory goes first: after an interrupt anywhere here the rows still live are garbage
        no key points at."""
        self._index.clear()
        self._pending_erase = self._pending_upsert = None  # (nothing to finish: every row goes)
        for seg in list(self._segments.values()):
            self._forget(seg)
        self._active = None
        self._unsettled = None
        self._broken = None
        self.collect_garbage()

    # -- compaction -----------------------------------------------------------------------
    def _maybe_compact(self) -> None:
        """Compact the emptiest sealed segments while garbage is above ``garbage_ratio`` of the
        live slots (down to GARBAGE_TARGET), and merge small sealed segments (the ones each
        snapshot seals) once there are more than SMALL_SEGMENTS of them."""
        retired = False
        if self._slots_total - len(self._index) > self.garbage_ratio * self._slots_total:
            target = min(GARBAGE_TARGET, self.garbage_ratio / 2)
            victims = sorted((s for s in self._segments.values() if s.sealed and s.owned),
                             key=lambda s: (s.live / max(1, s.n_slots), s.id))
            for seg in victims:
                if self._slots_total - len(self._index) <= target * self._slots_total \
                        or seg.live == seg.n_slots:
                    break
                self._compact(seg)
                retired = True
        small = sorted((s for s in self._segments.values()
                        if s.sealed and s.owned and s.n_slots < self.pool.segment_rows // 4),
                       key=lambda s: (s.live, s.id))
        if len(small) > SMALL_SEGMENTS:
            for seg in small[:len(small) - SMALL_SEGMENTS // 2]:
                self._compact(seg)
            retired = True
        if retired:
            self.collect_garbage()

    def _compact(self, seg) -> None:
        """Append the live rows of sealed segment ``seg`` again and retire it. A failure (a
        full disk) leaves ``seg`` in the live table with the rows not yet moved, each key at
        exactly one place: a StoreError saying so."""
        try:
            self._compact_rows(seg)
        except StoreError as e:
            raise StoreError(f"{self.name}: compacting segment {seg.path('rows')!r} stopped, "
                             f"every row written is kept where the table finds it: {e}") from None

    def _compact_rows(self, seg) -> None:
        oldest = seg.id == min(s.id for s in self._segments.values())
        step = 1 << 16
        for s0 in range(0, seg.n_slots, step):
            keys = np.array(seg.keys[s0:s0 + step])
            locs = seg.base + np.arange(s0, s0 + keys.shape[0], dtype=np.int64)
            pos = self._index.positions_of_locations(keys, locs)
            live = pos >= 0
            if not live.any():
                continue
            lines = self.read_locations(locs[live])
            new = self._append(keys[live], lines)
            self._index.set_locations(pos[live], new)
            self._count_live(new, 1)
            seg.live -= int(live.sum())
            self.io_counts["compacted_rows"] += int(live.sum())
        if not oldest:
            # tombstones still matter while an older live segment may hold the erased key
            dead = self.pool.read_dead(seg.info, self.pool.folder)
            if dead.shape[0]:
                gone = self._index.positions(dead[:, 0], self._keys_of) < 0
                active = self._writable_active()
                if active is None:
                    active = self._new_segment()
                at = active.n_slots
                active.dead.extend([(k, at) for k in dead[gone, 0].tolist()])
        self.io_counts["compactions"] += 1
        self._forget(seg)

    def close(self) -> None:
        """Close every segment; the live table is scratch (snapshots hold what was saved), so
        segments no snapshot refers to are deleted. Nothing at all in a process forked from the
        owner: the files are the owner's, still in use (a child's exit deleted them)."""
        if self._io is None or os.getpid() != self._owner_pid:
            return
        for seg in list(self._segments.values()):
            self._forget(seg)
        self._active = None
        try:
            self.collect_garbage()
        except OSError:
            pass
        self._read_buffer.release()
        self._write_buffer.release()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._io.close()
        self._io = None

    def __del__(self):
        if getattr(self, "_io", None) is None:   # closed, or never fully built
            return
        if os.getpid() != getattr(self, "_owner_pid", None):  # a forked child's copy
            return
        try:
            self.close()
        except Exception as e:  # garbage collection cannot raise: the reason is logged
            log.warning("%s was not closed, and closing it at garbage collection failed: %r",
                        self.name, e)


def _allocated(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0
