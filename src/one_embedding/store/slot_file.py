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
  kernel copies the rows out.
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
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
from numba import njit

from ..errors import StoreError
from ..tiers import StoreTier, empty_lines
from ..tiers.compact_index import MAX_LOCATION, CompactIndex
from . import segments as seg_files
from .direct_io import AlignedBuffer, IOPool
from .durable import write_failed
from .segments import SegmentPool, block_checksums, block_layout, default_segment_rows
from .slot_snapshots import SlotSnapshots
from .snapshots import SnapshotDirectory

log = logging.getLogger(__name__)

__all__ = ["SlotFileStore", "block_layout"]

_PARALLEL_ROWS = 1 << 14  # below this a second copy thread costs more than it saves
#: the staging buffers: blocks of one read or write pass (explicit RAM, not page cache)
IO_CHUNK_BYTES = 32 << 20
#: compaction starts when garbage passes this share of the live segments' slots ...
GARBAGE_RATIO = 0.3
#: ... and stops below this share
GARBAGE_TARGET = 0.2
#: sealed segments under a quarter of ``segment_rows`` kept before the smallest are merged
SMALL_SEGMENTS = 32
_MAX_INITIAL_KEYS = 1 << 20


@njit(cache=True, nogil=True)
def _gather(view, pos, within, out, out_rows, start, stop):
    """out[out_rows[i]] = view[pos[i], within[i]] for i in start..stop-1.

    view: (blocks, rows_per_block, line_size) float32, the staging buffer; pos, within: (n,)
    int64 block in the buffer and row in the block."""
    # explicit column loops: numba's slice copy on a strided view is 3x slower
    for i in range(start, stop):
        o, b, r = out_rows[i], pos[i], within[i]
        for c in range(out.shape[1]):
            out[o, c] = view[b, r, c]


@njit(cache=True, nogil=True)
def _scatter(view, pos, within, lines, line_rows, start, stop):
    """view[pos[i], within[i]] = lines[line_rows[i]] for i in start..stop-1."""
    for i in range(start, stop):
        o, b, r = line_rows[i], pos[i], within[i]
        for c in range(lines.shape[1]):
            view[b, r, c] = lines[o, c]


class SlotFileStore(SlotSnapshots, StoreTier):
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
        if self._free_indices:
            return self._free_indices.pop()
        index = len(self._segments)
        if (index + 1) * self.pool.segment_rows - 1 > MAX_LOCATION:
            raise StoreError(f"{self.name}: {index} live segments of {self.pool.segment_rows} rows "
                             "fill the 32-bit location space of the directory")
        return index

    # -- batched row I/O ----------------------------------------------------------------------
    def _staging(self, buffer: AlignedBuffer, n_blocks: int):
        """``buffer`` sized for ``n_blocks`` blocks, with its (n_blocks, rows_per_block,
        line_size) float32 view and its (n_blocks, block_bytes) uint8 view."""
        bb, rpb = self.pool.block_bytes, self.pool.rows_per_block
        buf = buffer.get(n_blocks * bb)
        rows = np.ndarray((n_blocks, rpb, self.line_size), np.float32, buffer=buf,
                          strides=(bb, 4 * self.line_size, 4))
        raw = np.ndarray((n_blocks, bb), np.uint8, buffer=buf)
        return buf, rows, raw

    def _copy(self, kernel, view, pos, within, data, data_rows) -> None:
        """Run ``kernel`` over rows 0..n-1, split over ``threads`` when the batch is big."""
        n = pos.shape[0]
        if self._pool is None or n < _PARALLEL_ROWS:
            kernel(view, pos, within, data, data_rows, 0, n)
            return
        bounds = np.linspace(0, n, self.threads + 1).astype(np.int64)
        futures = [self._pool.submit(kernel, view, pos, within, data, data_rows,
                                     int(bounds[t]), int(bounds[t + 1]))
                   for t in range(self.threads)]
        for f in futures:
            f.result()

    def _chunk_blocks(self) -> int:
        return max(1, IO_CHUNK_BYTES // self.pool.block_bytes)

    def read_locations(self, locs: np.ndarray, out: np.ndarray | None = None,
                       out_rows: np.ndarray | None = None) -> np.ndarray:
        """locs: (n,) int64 locations -> lines (n, line_size) float32, or into ``out[out_rows]``.

        Each distinct block is read once, in file order, ``io_threads`` reads in flight."""
        self._check()
        n = locs.shape[0]
        if out is None:
            out = np.empty((n, self.line_size), np.float32)
            out_rows = np.arange(n, dtype=np.int64)
        if n == 0:
            return out
        rpb = self.pool.rows_per_block
        seg, slot = self._split(np.ascontiguousarray(locs, np.int64))
        block = slot // rpb
        within = slot - block * rpb
        # one sort key: (segment, block) in location order
        ordinal = seg * (self.pool.segment_rows // rpb + 1) + block
        order = np.argsort(ordinal)
        ordinal, seg, block, within = ordinal[order], seg[order], block[order], within[order]
        rows = np.ascontiguousarray(out_rows, np.int64)[order]
        first = np.ones(n, np.bool_)
        first[1:] = ordinal[1:] != ordinal[:-1]
        blocks, block_segs = block[first], seg[first]     # (k,) distinct blocks
        pos = np.cumsum(first) - 1                         # (n,) each row's block
        # each pass reads at most a staging buffer of blocks from at most max_files segments
        seg_rank = np.cumsum(np.r_[True, block_segs[1:] != block_segs[:-1]]) - 1
        max_files = max(1, self.pool.handles.max_files)
        c0, chunk = 0, self._chunk_blocks()
        while c0 < blocks.shape[0]:
            c1 = min(c0 + chunk, blocks.shape[0],
                     int(np.searchsorted(seg_rank, seg_rank[c0] + max_files)))
            r0, r1 = np.searchsorted(pos, [c0, c1])
            fds = self._open_rows(block_segs[c0:c1])
            buf, view, raw = self._staging(self._read_buffer, c1 - c0)
            t0 = time.perf_counter()
            try:
                self._io.read(fds, blocks[c0:c1], self.pool.block_bytes, buf)
                self.read_seconds += time.perf_counter() - t0
            except OSError as e:
                self._check_rows_sizes(block_segs[c0:c1], blocks[c0:c1])  # names a short file
                raise StoreError(f"{self.name}: reading a segment under {self.pool.folder!r} "
                                 f"failed ({e.strerror or e}); check the disk, then load the last "
                                 "snapshot") from None
            self._check_sums(raw, block_segs[c0:c1], blocks[c0:c1])
            self._copy(_gather, view, pos[r0:r1] - c0, within[r0:r1], out, rows[r0:r1])
            c0 = c1
        self.io_counts["read_blocks"] += int(blocks.shape[0])
        return out

    def _check_sums(self, raw: np.ndarray, segs: np.ndarray, blocks: np.ndarray) -> None:
        """Blocks just read (raw: (k, block_bytes) uint8; their segment indices and block
        numbers, (k,) int64) against the checksums written with them (each segment's own
        function: a snapshot of format 2 brings segments of the legacy one)."""
        expected = self._per_segment("sums", segs, blocks)
        legacy = self._legacy_table()[segs]
        if not legacy.any():
            got = block_checksums(raw)
        else:
            got = np.empty(raw.shape[0], np.uint64)
            for flag in (False, True):
                part = np.flatnonzero(legacy == flag)
                if part.shape[0]:
                    got[part] = block_checksums(raw[part], seg_files.LEGACY_BLOCK_CHECKSUM
                                                if flag else seg_files.BLOCK_CHECKSUM)
        bad = np.flatnonzero(got != expected)
        if bad.shape[0]:
            seg = self._segments[int(segs[bad[0]])]
            raise StoreError(
                f"{self.name}: block {int(blocks[bad[0]])} of {seg.path('rows')!r} fails its "
                "checksum: the segment is damaged; load another snapshot (one-embedding inspect "
                "lists the intact ones)")

    def _check_rows_sizes(self, segs: np.ndarray, blocks: np.ndarray) -> None:
        """Raise StoreError naming a rows file shorter than the blocks (k,) int64 of the
        segments (k,) int64 that a read wanted from it."""
        for index in np.unique(segs).tolist():
            end = int(blocks[segs == index].max()) + 1
            self._segments[index].check_rows_size(end * self.pool.block_bytes)

    def _open_rows(self, segs: np.ndarray) -> np.ndarray:
        """segs: (k,) int64 segment indices, ascending -> (k,) int32 their rows files'
        descriptors, all open together (the pool's budget reopens closed ones)."""
        starts = np.r_[0, np.flatnonzero(segs[1:] != segs[:-1]) + 1]
        fds = self.pool.open_rows([self._segments[int(i)] for i in segs[starts].tolist()])
        return np.repeat(np.asarray(fds, np.int32), np.diff(np.r_[starts, segs.shape[0]]))

    def _legacy_table(self) -> np.ndarray:
        """(max index + 1,) bool: whether a live segment's block checksums are the legacy ones
        (rebuilt when the live segments change)."""
        if self._legacy is None:
            self._legacy = np.zeros(max(self._segments, default=-1) + 1, np.bool_)
            for index, seg in self._segments.items():
                self._legacy[index] = seg.checksum == seg_files.LEGACY_BLOCK_CHECKSUM
        return self._legacy

    def _append(self, keys: np.ndarray, lines: np.ndarray) -> np.ndarray:
        """Append rows (keys (n,) uint64, lines (n, line_size) float32) to the active segment,
        sealing it and starting another when it is full. Returns their locations (n,) int64.
        The directory is not touched."""
        n = keys.shape[0]
        locs = np.empty(n, np.int64)
        done = 0
        while done < n:
            seg = self._active
            if seg is None:
                seg = self._active = self._new_segment()
            take = min(seg.capacity - seg.n_slots, n - done)
            if take == 0:
                self._seal_active()
                continue
            start = seg.n_slots
            self._write_into(seg, keys[done:done + take], lines[done:done + take])
            locs[done:done + take] = seg.base + np.arange(start, start + take)
            done += take
        return locs

    def _new_segment(self):
        """The next active segment. Its capacity follows the table (an eighth of the rows held,
        a power of two from 1024 up to ``segment_rows``), so a small table's garbage, which
        stays in the active segment until it is sealed, stays small too."""
        index = self._take_index()
        want = max(1024, len(self._index) // 8)
        capacity = min(self.pool.segment_rows, 1 << (want - 1).bit_length())
        try:
            seg = self.pool.create(self._next_id, index, capacity)
        except BaseException:
            # the index goes back: lost, the next segment would take a live one's (len(...))
            self._free_indices.append(index)
            raise
        self._next_id += 1
        self._add(seg)
        return seg

    def _add(self, seg) -> None:
        self._segments[seg.index] = seg
        self._slots_total += seg.n_slots
        self._legacy = None

    def _write_into(self, seg, keys: np.ndarray, lines: np.ndarray) -> None:
        """Rows go to slots seg.n_slots.. of ``seg``: whole blocks, the partly filled last block
        rewritten with the rows it held. The block images pass through the write buffer, where
        the CRC32 of each block that is final (full) is taken."""
        rpb, bb = self.pool.rows_per_block, self.pool.block_bytes
        m = keys.shape[0]
        s0, s1 = seg.n_slots, seg.n_slots + m
        first_block, end_block = s0 // rpb, -(-s1 // rpb)
        slots = np.arange(s0, s1, dtype=np.int64)
        block = slots // rpb
        within = slots - block * rpb
        line_rows = np.arange(m, dtype=np.int64)
        chunk = self._chunk_blocks()
        final_blocks = s1 // rpb  # blocks below this are full after the write
        seg.append_keys(keys)  # first: a failure (StoreError) changes nothing of the segment
        for b0 in range(first_block, end_block, chunk):
            b1 = min(b0 + chunk, end_block)
            r0, r1 = np.searchsorted(block, [b0, b1])
            buf, view, raw = self._staging(self._write_buffer, b1 - b0)
            # every byte written is deterministic (the same file on both I/O paths): the rows
            # fill the blocks, the partly filled first block comes whole from its last image,
            # and only the block padding and the free rows of a partly filled last block are
            # zeroed (not the whole buffer: a step writes tens of MB)
            raw[:, rpb * 4 * self.line_size:] = 0
            if b0 == first_block and seg.tail is not None:
                raw[0] = np.frombuffer(seg.tail, np.uint8)
            if b1 == end_block and s1 % rpb:
                view[-1, s1 % rpb:] = 0
            self._copy(_scatter, view, block[r0:r1] - b0, within[r0:r1], lines, line_rows[r0:r1])
            seg.sums[b0:b1] = block_checksums(raw, seg.checksum)
            try:
                self._io.write(seg.fd(), np.arange(b0, b1, dtype=np.int64), bb, buf)
            except OSError as e:
                # (rows files are preallocated: a file system that still refuses a write, such
                # as a copy-on-write one that is full) the rewritten last block may be half
                # written: its earlier rows are suspect
                self._broken = write_failed(
                    "writing the rows of", self.pool.path(seg.id, "rows"), e,
                    "load_snapshot restores the last snapshot (the live table is inconsistent)")
                raise StoreError(f"{self.name}: {self._broken}") from None
            for b in range(max(b0, seg.crc_blocks), min(b1, final_blocks)):
                seg.rows_crc = zlib.crc32(raw[b - b0], seg.rows_crc)
                seg.crc_blocks = b + 1
            if b1 == end_block:
                seg.tail = raw[-1].tobytes() if s1 % rpb else None
        self.io_counts["written_blocks"] += end_block - first_block
        seg.n_slots = s1
        self._slots_total += m

    def _seal_active(self) -> None:
        seg, self._active = self._active, None
        if seg is None:
            return
        if seg.n_slots == 0 and not seg.dead:
            self._forget(seg)
            return
        try:
            self.pool.seal(seg)
        except OSError as e:
            self._active = seg  # still active and whole: sealed again by the next save
            raise StoreError(f"{self.name}: " + write_failed(
                "sealing the segment", seg.path("rows"), e, "save again")) from None

    def _forget(self, seg) -> None:
        """Take ``seg`` out of the live table and close it (its files stay until GC)."""
        del self._segments[seg.index]
        self._free_indices.append(seg.index)
        self._slots_total -= seg.n_slots
        self._legacy = None
        seg.close()

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
        if keys.shape[0] == 0:
            return empty_lines(self.line_size)
        locs = self._append(keys, lines)  # a full disk fails here, the directory untouched
        old = self._index.upsert(keys, locs, self._keys_of)
        self._count_live(locs, 1)
        self._count_live(old[old >= 0], -1)
        self._maybe_compact()
        return empty_lines(self.line_size)

    def erase(self, keys: np.ndarray) -> int:
        """Delete keys (n,) uint64 (absent ones are ignored); returns how many were stored. A
        tombstone in the active segment keeps an older segment from bringing them back when a
        snapshot is replayed."""
        self._check()
        keys = np.ascontiguousarray(keys, np.uint64)
        pos = self._index.positions(keys, self._keys_of)
        held = pos >= 0
        if not held.any():
            return 0
        if self._active is None:  # first: a full disk fails here, before a key goes
            self._active = self._new_segment()
        self._count_live(self._index.locations_at(pos[held]), -1)
        self._index.erase_at(pos[held])
        at = self._active.n_slots
        self._active.dead.extend((int(k), at) for k in keys[held])
        self._maybe_compact()
        return int(held.sum())

    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        locs = self._index.locations()
        keys = self._keys_of(locs)
        order = np.argsort(keys, kind="stable")
        keys, locs = keys[order], locs[order]
        for start in range(0, keys.shape[0], batch_rows):
            stop = start + batch_rows
            yield keys[start:stop], self.read_locations(locs[start:stop])

    def clear(self) -> None:
        """Drop every row: the live table becomes empty (its segments go at the next GC)."""
        self._active = None
        for seg in list(self._segments.values()):
            self._forget(seg)
        self._index.clear()
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
                if self._active is None:
                    self._active = self._new_segment()
                at = self._active.n_slots
                self._active.dead.extend((int(k), at) for k in dead[gone, 0])
        self.io_counts["compactions"] += 1
        self._forget(seg)

    def close(self) -> None:
        """Close every segment; the live table is scratch (snapshots hold what was saved), so
        segments no snapshot refers to are deleted."""
        if self._io is None:
            return
        self._active = None
        for seg in list(self._segments.values()):
            self._forget(seg)
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
