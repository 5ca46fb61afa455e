"""Segment files of the slot engine: runs of rows written once, in order, then never changed.

A segment is a numbered set of files in the pool folder ``<directory>/slots/segments/``:

- ``<id>.rows``: its rows, packed into blocks (``block_layout``): slot ``s`` is row ``s %
  rows_per_block`` of block ``s // rows_per_block``. Written by appending; only the last, partly
  filled block is written again (with the rows it already held) until it is full.
- ``<id>.keys``: the key of every slot, raw little-endian uint64, appended with the rows and
  synced when the segment is sealed. The engine's RAM directory holds no keys; it reads them
  here (mapped, so through the page cache, 8 bytes a row) to confirm a tag match, to grow, and
  to rebuild itself when a snapshot loads.
- ``<id>.sums``: a 64-bit checksum of every block of the rows file (``block_sums``), written when
  the segment is sealed (kept in RAM while it is active). Every block read is checked against
  it, so a damaged row is an error naming the file, never a silently wrong embedding.
- ``<id>.dead``: tombstones, ``(key, position)`` uint64 pairs: the key was erased before slot
  ``position`` of this segment was written. Only when there are some.

``<id>`` is 16 hex digits; ids only grow, so ascending ids are the order rows were written, and
replaying the segments of a snapshot in that order (later rows of a key win, a tombstone erases
what came before it) rebuilds exactly the table that was saved. A sealed segment is immutable:
snapshots refer to it by id, size and CRC32s (``SegmentInfo``) rather than copying it, and
garbage collection deletes its files once neither the live table nor a snapshot refers to it.
"""
from __future__ import annotations

import os
import re
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from numba import njit

from ..errors import SnapshotError, StoreError
from .direct_io import check_alignment, open_block_file, warn_buffered
from .durable import file_crc32, fsync_dir
from .file_limit import too_many_open_files

_ID_RE = re.compile(r"^([0-9a-f]{16})\.(rows|keys|sums|dead)$")
KINDS = ("rows", "keys", "sums", "dead")
_SUM_SEED = np.uint64(0x9E3779B97F4A7C15)
_SUM_MUL = np.uint64(0xFF51AFD7ED558CCD)

# The syscall that preallocates a segment, named so a test can make it fail (ENOSPC).
_allocate = os.posix_fallocate


@njit(cache=True, nogil=True)
def block_sums(words, out):
    """out[b]: a 64-bit checksum of block b. words: (k, block_bytes // 8) uint64, the blocks;
    out: (k,) uint64. Four independent multiply-xor lanes (so the CPU overlaps them), folded."""
    for b in range(words.shape[0]):
        h0 = _SUM_SEED
        h1 = _SUM_SEED ^ np.uint64(1)
        h2 = _SUM_SEED ^ np.uint64(2)
        h3 = _SUM_SEED ^ np.uint64(3)
        for i in range(0, words.shape[1] - 3, 4):
            h0 = (h0 ^ words[b, i]) * _SUM_MUL
            h1 = (h1 ^ words[b, i + 1]) * _SUM_MUL
            h2 = (h2 ^ words[b, i + 2]) * _SUM_MUL
            h3 = (h3 ^ words[b, i + 3]) * _SUM_MUL
        h = h0 ^ (h1 >> np.uint64(17)) ^ (h2 << np.uint64(23)) ^ (h3 >> np.uint64(41))
        out[b] = (h ^ (h >> np.uint64(33))) * _SUM_MUL


@njit(cache=True, nogil=True)
def first_bad_block(words, expected):
    """The first block of ``words`` (k, block_bytes // 8) uint64 whose checksum is not
    ``expected`` (k,) uint64, or -1."""
    got = np.empty(1, np.uint64)
    for b in range(words.shape[0]):
        block_sums(words[b:b + 1], got)
        if got[0] != expected[b]:
            return b
    return -1


def block_layout(line_size: int, physical_block_size: int) -> tuple[int, int]:
    """(rows_per_block, block_bytes) for rows of ``line_size`` float32: as many whole rows as fit
    a block (no row straddles two), or one row over as many blocks as it needs."""
    row_bytes = 4 * line_size
    if row_bytes <= physical_block_size:
        return physical_block_size // row_bytes, physical_block_size
    return 1, -(-row_bytes // physical_block_size) * physical_block_size


def default_segment_rows(line_size: int, target_bytes: int = 64 << 20) -> int:
    """Slots a segment holds: the power of two nearest ``target_bytes`` of rows, in 2**8..2**20
    (so the 32-bit locations of the directory address 2**32 rows whatever the row size)."""
    rows = max(1, target_bytes // (4 * line_size))
    return 1 << min(20, max(8, int(round(np.log2(rows)))))


@dataclass
class SegmentInfo:
    """What a snapshot records of a sealed segment (slots.json), and what a load checks."""

    id: int
    slots: int
    rows_bytes: int
    rows_crc32: int
    keys_crc32: int
    sums_crc32: int = 0
    dead: int = 0
    dead_crc32: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SegmentInfo":
        try:
            return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d})
        except (TypeError, ValueError, KeyError) as e:
            raise SnapshotError(f"a segment entry {d!r} is malformed ({e})") from None


class Segment:
    """One segment of the live table. ``index``: its number in the directory's location space
    (location = index * pool.segment_rows + slot); ``keys``: (n_slots,) uint64, a read-only map
    of the keys file (``append_keys`` extends it while active); ``live``: slots still current."""

    def __init__(self, pool: "SegmentPool", seg_id: int, index: int, fd: int, sealed: bool,
                 keys: np.ndarray, n_slots: int, owned: bool, capacity: int):
        self.pool, self.id, self.index, self.fd = pool, seg_id, index, fd
        self.sealed, self.keys, self.n_slots, self.owned = sealed, keys, n_slots, owned
        self.capacity = capacity  # slots it may hold (<= pool.segment_rows)
        self.live = 0
        self.dead: list[tuple[int, int]] = []  # tombstones (key, position), active only
        self.info: SegmentInfo | None = None   # set once sealed
        self.rows_crc = 0          # CRC32 of the blocks that will not change again
        self.crc_blocks = 0        # ... how many of them (a prefix of the file)
        self.tail = None           # bytes of the partly filled last block (active only)
        self.sums = np.empty(0, np.uint64)  # block checksums: RAM while active, then mapped
        self.keys_fd = None        # the keys file, open for appending while active

    @property
    def base(self) -> int:
        return self.index * self.pool.segment_rows

    def append_keys(self, keys: np.ndarray) -> None:
        """keys: (m,) uint64 of the rows just written at slots n_slots..n_slots+m-1."""
        start = self.n_slots
        data = np.ascontiguousarray(keys, np.uint64).tobytes()
        done = 0
        while done < len(data):
            done += os.pwrite(self.keys_fd, data[done:], 8 * start + done)
        self.keys = _map_array(self.pool.path(self.id, "keys"), start + keys.shape[0])

    def close(self) -> None:
        for fd in (self.fd, self.keys_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.keys_fd = None
        self.keys = self.sums = None


class SegmentPool:
    """The pool folder and the layout of the segments in it."""

    def __init__(self, folder: str, line_size: int, physical_block_size: int, segment_rows: int,
                 direct: bool = True):
        self.folder = folder
        self.line_size = int(line_size)
        self.rows_per_block, self.block_bytes = block_layout(self.line_size, physical_block_size)
        self.segment_rows = int(segment_rows)
        self.direct = direct
        os.makedirs(folder, exist_ok=True)

    # -- layout -----------------------------------------------------------------------------
    def adopt(self, rows_per_block: int, block_bytes: int, segment_rows: int) -> None:
        """Take another layout (a loaded snapshot's): new segments are written like its own."""
        self.rows_per_block, self.block_bytes = int(rows_per_block), int(block_bytes)
        self.segment_rows = int(segment_rows)

    def blocks_for(self, n_slots: int) -> int:
        return -(-int(n_slots) // self.rows_per_block)

    def path(self, seg_id: int, kind: str, folder: str | None = None) -> str:
        return os.path.join(folder or self.folder, f"{seg_id:016x}.{kind}")

    def ids_on_disk(self) -> set[int]:
        out = set()
        for entry in os.listdir(self.folder):
            m = _ID_RE.match(entry)
            if m:
                out.add(int(m.group(1), 16))
        return out

    # -- creating, sealing, opening ---------------------------------------------------------
    def create(self, seg_id: int, index: int, capacity: int) -> Segment:
        """A new, empty segment with room for ``capacity`` (<= segment_rows) rows preallocated
        (a full disk fails here, before any row moves)."""
        path = self.path(seg_id, "rows")
        try:
            fd, direct = open_block_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct,
                                         warn_as=self.folder)
        except OSError as e:
            raise too_many_open_files(path, e) or StoreError(
                f"cannot create the segment {path!r} ({e.strerror or e}): give a "
                "persistent_path this process can write") from None
        keys_path = self.path(seg_id, "keys")
        try:
            _allocate(fd, 0, self.blocks_for(capacity) * self.block_bytes)
            if direct and not check_alignment(fd, self.block_bytes):
                os.close(fd)
                fd = None       # closed: an error opening it again must not close it twice
                fd = os.open(path, os.O_RDWR)
                direct = False
                warn_buffered(self.folder, f"O_DIRECT refuses {self.block_bytes}-byte blocks here")
            keys_fd = os.open(keys_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            # nothing of the segment stays behind: neither its descriptor nor its rows file
            # (a keys file is created last: a failure to create it leaves none)
            if fd is not None:
                os.close(fd)
            os.unlink(path)
            raise too_many_open_files(path, e) or StoreError(
                f"cannot allocate the segment {path!r} ({e.strerror or e}); free disk space or "
                "move persistent_path to a bigger disk. The rows held so far are unchanged and "
                "the last snapshot is intact") from None
        self.direct = direct
        seg = Segment(self, seg_id, index, fd, False, np.empty(0, np.uint64), 0, True, capacity)
        seg.sums = np.zeros(self.blocks_for(capacity), np.uint64)
        seg.keys_fd = keys_fd
        return seg

    def seal(self, seg: Segment) -> SegmentInfo:
        """Make ``seg`` immutable and durable: its rows file cut to the blocks used and synced,
        its keys (and tombstones) written and synced. Returns what a snapshot records of it."""
        n_blocks = self.blocks_for(seg.n_slots)
        if seg.tail is not None:  # the partly filled last block is final now
            seg.rows_crc = zlib.crc32(seg.tail, seg.rows_crc)
        sums = np.ascontiguousarray(seg.sums[:n_blocks])
        dead = np.array(seg.dead, np.uint64).reshape(-1, 2)
        os.ftruncate(seg.fd, n_blocks * self.block_bytes)
        os.fdatasync(seg.fd)
        os.fsync(seg.keys_fd)
        keys_crc = zlib.crc32(seg.keys[:seg.n_slots]) if seg.n_slots else 0
        _write_synced(self.path(seg.id, "sums"), sums.tobytes())
        if dead.shape[0]:
            _write_synced(self.path(seg.id, "dead"), dead.tobytes())
        fsync_dir(self.folder)
        seg.info = SegmentInfo(seg.id, seg.n_slots, n_blocks * self.block_bytes, seg.rows_crc,
                               keys_crc, zlib.crc32(sums.tobytes()),
                               int(dead.shape[0]),
                               zlib.crc32(dead.tobytes()) if dead.shape[0] else 0)
        seg.sealed, seg.tail, seg.dead = True, None, []
        os.close(seg.keys_fd)
        seg.keys_fd = None
        seg.sums = _map_array(self.path(seg.id, "sums"), n_blocks)
        return seg.info

    def check(self, info: SegmentInfo, folder: str, block_bytes: int, full: bool = False) -> None:
        """Raise SnapshotError unless the files of ``info`` in ``folder`` (written with blocks of
        ``block_bytes``) have the recorded sizes and key, checksum and tombstone CRC32s; ``full``
        also reads every row block for its CRC32."""
        expect = {"rows": info.rows_bytes, "keys": 8 * info.slots,
                  "sums": 8 * (info.rows_bytes // block_bytes), "dead": 16 * info.dead}
        for kind in KINDS:
            if kind == "dead" and not info.dead:
                continue
            path = self.path(info.id, kind, folder)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise SnapshotError(f"segment file {path!r} is missing") from None
            if size != expect[kind]:
                raise SnapshotError(f"segment file {path!r} has {size} bytes, not "
                                    f"{expect[kind]}: damaged")
        checks = [("keys", info.keys_crc32), ("sums", info.sums_crc32)] + \
            ([("dead", info.dead_crc32)] if info.dead else [])
        if full:
            checks.append(("rows", info.rows_crc32))
        for kind, want in checks:
            path = self.path(info.id, kind, folder)
            if file_crc32(path) != want:
                raise SnapshotError(f"segment file {path!r} fails its checksum: damaged")

    def open_sealed(self, info: SegmentInfo, index: int, folder: str, owned: bool) -> Segment:
        """A sealed segment of a snapshot, read only (``owned``: in this pool, so GC may delete
        it once nothing refers to it; a foreign one is never deleted)."""
        path = self.path(info.id, "rows", folder)
        try:
            fd, direct = open_block_file(path, os.O_RDONLY, self.direct, warn_as=self.folder)
        except OSError as e:
            raise too_many_open_files(path, e) or SnapshotError(
                f"cannot open segment {path!r} ({e.strerror or e})") from None
        try:
            if direct and info.rows_bytes and not check_alignment(fd, self.block_bytes):
                os.close(fd)
                fd = None       # closed: an error opening it again must not close it twice
                fd = os.open(path, os.O_RDONLY)
                warn_buffered(self.folder, f"O_DIRECT refuses {self.block_bytes}-byte blocks here")
            keys = _map_array(self.path(info.id, "keys", folder), info.slots)
            sums = _map_array(self.path(info.id, "sums", folder),
                              info.rows_bytes // self.block_bytes)
        except (OSError, ValueError) as e:     # ValueError: numpy maps a file shorter than n
            if fd is not None:
                os.close(fd)
            limit = too_many_open_files(path, e) if isinstance(e, OSError) else None
            raise limit or SnapshotError(f"cannot open segment {info.id:016x} in {folder!r} "
                                         f"({e}): damaged or incomplete") from None
        seg = Segment(self, info.id, index, fd, True, keys, info.slots, owned, info.slots)
        seg.sums = sums
        seg.info = info
        return seg

    def read_dead(self, info: SegmentInfo, folder: str) -> np.ndarray:
        """The tombstones (m, 2) uint64 of a sealed segment."""
        if not info.dead:
            return np.empty((0, 2), np.uint64)
        return np.fromfile(self.path(info.id, "dead", folder), np.uint64).reshape(-1, 2)

    def delete(self, seg_id: int) -> None:
        for kind in KINDS:
            try:
                os.unlink(self.path(seg_id, kind))
            except FileNotFoundError:
                pass


def _map_array(path: str, n: int) -> np.ndarray:
    """The first ``n`` uint64 of a file, mapped read-only (page cache, not process RAM)."""
    if n == 0:
        return np.empty(0, np.uint64)
    return np.memmap(path, np.uint64, "r", shape=(n,))


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
