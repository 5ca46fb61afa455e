"""The slot engine's block I/O (``SlotFileStore`` inherits it): rows to and from whole blocks of
the segments' rows files, through staging buffers of explicit RAM (not the page cache).

- A read (``read_locations``) resolves locations to (segment, block, row), reads each distinct
  block once, in file order (runs of adjacent blocks in one call, ``io_threads`` requests in
  flight, across segment files, at most IO_CHUNK_BYTES a pass), checks each block against the
  checksum written with it (each segment's own function: legacy segments keep theirs), and a
  numba kernel copies the rows out.
- A write (``_write_into``) lays rows into whole block images (the partly filled last block
  rewritten with the rows it held), takes each block's checksum and the CRC32 of the blocks
  that are final, and writes them; a failed write marks the live table broken.
"""
from __future__ import annotations

import time
import zlib

import numpy as np
from numba import njit

from ..errors import StoreError
from . import segments as seg_files
from .direct_io import AlignedBuffer
from .durable import write_failed
from .segments import block_checksums

_PARALLEL_ROWS = 1 << 14  # below this a second copy thread costs more than it saves
#: the staging buffers: blocks of one read or write pass (explicit RAM, not page cache)
IO_CHUNK_BYTES = 32 << 20


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


class SlotBlockIO:
    """Block reads and writes of ``SlotFileStore`` (it provides the pool, the live segments,
    the staging buffers, the I/O and copy thread pools and the counters)."""

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
        self._settle_write()  # (a block an interrupted write left on disk is put back)
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

    #: a block write not yet settled (interrupt safety): None, or (segment, redo). ``redo`` is
    #: None while the blocks are written (the segment's state is the one before the write, but
    #: its partly filled last block may hold a newer image on disk), else the segment's state
    #: after the write: (n_slots, rows written, first block, block checksums from it, rows CRC,
    #: CRC blocks, tail), applied by ``_settle_write`` (again, after an interrupt: idempotent)
    _unsettled = None

    def _settle_write(self, recovering: bool = True) -> None:
        """Finish what a write an interrupt stopped left: its new state is applied if its blocks
        were all written, else the image of the partly filled last block it may have
        overwritten on disk goes back (the retry writes the rows again). Every read, write,
        erase and seal calls it first."""
        pending = self._unsettled
        if pending is None:
            return
        seg, redo = pending
        live = self._segments.get(seg.index) is seg and seg.info is None and not seg.sealed
        if live and redo is not None:
            s1, m, first_block, sums, rows_crc, crc_blocks, tail = redo
            seg.sums[first_block:first_block + sums.shape[0]] = sums
            seg.rows_crc, seg.crc_blocks, seg.tail = rows_crc, crc_blocks, tail
            if recovering:  # (an interrupt may have stopped the count between the two)
                seg.n_slots = s1
                self._slots_total = sum(s.n_slots for s in self._segments.values())
            else:
                seg.n_slots = s1
                self._slots_total += m
        elif live and seg.tail is not None:
            self._write_blocks(seg, seg.n_slots // self.pool.rows_per_block, [seg.tail])
        self._unsettled = None

    def _write_blocks(self, seg, first: int, images) -> None:
        """Write whole block images (bytes) to blocks first.. of ``seg``'s rows file."""
        buf, _, raw = self._staging(self._write_buffer, len(images))
        for i, image in enumerate(images):
            raw[i] = np.frombuffer(image, np.uint8)
        self._io_write(seg, np.arange(first, first + len(images), dtype=np.int64), buf)

    def _io_write(self, seg, blocks: np.ndarray, buf) -> None:
        try:
            self._io.write(seg.fd(), blocks, self.pool.block_bytes, buf)
        except OSError as e:
            # (rows files are preallocated: a file system that still refuses a write, such
            # as a copy-on-write one that is full) the rewritten last block may be half
            # written: its earlier rows are suspect
            self._broken = write_failed(
                "writing the rows of", self.pool.path(seg.id, "rows"), e,
                "load_snapshot restores the last snapshot (the live table is inconsistent)")
            raise StoreError(f"{self.name}: {self._broken}") from None

    def _write_into(self, seg, keys: np.ndarray, lines: np.ndarray) -> None:
        """Rows go to slots seg.n_slots.. of ``seg``: whole blocks, the partly filled last block
        rewritten with the rows it held. The block images pass through the write buffer, where
        the CRC32 of each block that is final (full) is taken.

        Interrupt safety: the segment's state (slots, block checksums, rows CRC, tail) changes
        only once every block is written, from one record (``_unsettled``) set in one
        assignment; an interrupt before it leaves the segment as it was (``_settle_write``
        puts back the image of the partly filled block), after it the record is applied."""
        self._settle_write()
        rpb = self.pool.rows_per_block
        m = keys.shape[0]
        s0, s1 = seg.n_slots, seg.n_slots + m
        first_block, end_block = s0 // rpb, -(-s1 // rpb)
        slots = np.arange(s0, s1, dtype=np.int64)
        block = slots // rpb
        within = slots - block * rpb
        line_rows = np.arange(m, dtype=np.int64)
        chunk = self._chunk_blocks()
        final_blocks = s1 // rpb  # blocks below this are full after the write
        rows_crc, crc_blocks, tail = seg.rows_crc, seg.crc_blocks, seg.tail
        sums = np.empty(end_block - first_block, np.uint64)
        seg.append_keys(keys)  # first: a failure (StoreError) changes nothing of the segment
        self._unsettled = (seg, None)
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
            sums[b0 - first_block:b1 - first_block] = block_checksums(raw, seg.checksum)
            self._io_write(seg, np.arange(b0, b1, dtype=np.int64), buf)
            for b in range(max(b0, crc_blocks), min(b1, final_blocks)):
                rows_crc = zlib.crc32(raw[b - b0], rows_crc)
                crc_blocks = b + 1
            if b1 == end_block:
                tail = raw[-1].tobytes() if s1 % rpb else None
        self._unsettled = (seg, (s1, m, first_block, sums, rows_crc, crc_blocks, tail))
        self._settle_write(recovering=False)
        self.io_counts["written_blocks"] += end_block - first_block
