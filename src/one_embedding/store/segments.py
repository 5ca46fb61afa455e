"""Segment files of the slot engine: runs of rows written once, in order, then never changed.

A segment is a numbered set of files in the pool folder ``<directory>/slots/segments/``:

- ``<id>.rows``: its rows, packed into blocks (``block_layout``): slot ``s`` is row ``s %
  rows_per_block`` of block ``s // rows_per_block``. Written by appending; only the last, partly
  filled block is written again (with the rows it already held) until it is full.
- ``<id>.keys``: the key of every slot, raw little-endian uint64, appended with the rows and
  synced when the segment is sealed. The engine's RAM directory holds no keys; it reads them
  here (mapped, so through the page cache, 8 bytes a row) to confirm a tag match, to grow, and
  to rebuild itself when a snapshot loads.
- ``<id>.sums``: a 64-bit checksum of every block of the rows file, written when the segment is
  sealed (kept in RAM while it is active): XXH3-64 (seed 0) of the block's bytes
  (``block_checksums``), or, in a segment written before snapshot format 3, the engine's earlier
  hand-made sum (``legacy_block_sums``, kept only to verify those). Every block read is checked
  against it, so a damaged row is an error naming the file, never a silently wrong embedding.
  ``SegmentInfo.block_checksum`` names the function a segment was written with.
- ``<id>.dead``: tombstones, ``(key, position)`` uint64 pairs: the key was erased before slot
  ``position`` of this segment was written. Only when there are some.

``<id>`` is 16 hex digits; ids only grow, so ascending ids are the order rows were written, and
replaying the segments of a snapshot in that order (later rows of a key win, a tombstone erases
what came before it) rebuilds exactly the table that was saved. A sealed segment is immutable:
snapshots refer to it by id, size and CRC32s (``SegmentInfo``) rather than copying it, and
garbage collection deletes its files once neither the live table nor a snapshot refers to it.

The keys and checksums are mapped, the rows read with ``pread``; the pool's ``HandleBudget``
(``handles.py``) bounds the descriptors and mappings it holds open, and every use of a mapping
checks the file's size first, so a file another process truncates is an error naming it, not
SIGBUS. The active segment's keys file is preallocated to its capacity (with its rows file: a
full disk fails when a segment is made, before a row moves) and mapped once, not once a write.
"""
from __future__ import annotations

import errno
import os
import re
import zlib
from dataclasses import asdict, dataclass

import numpy as np
import xxhash
from numba import njit

from ..errors import SnapshotError, StoreError
from .direct_io import check_alignment, open_block_file, warn_buffered
from .durable import file_crc32, fsync_dir, write_failed
from .file_limit import too_many_open_files
from .handles import HandleBudget, MappedWords, short_file_error

_ID_RE = re.compile(r"^([0-9a-f]{16})\.(rows|keys|sums|dead)$")
KINDS = ("rows", "keys", "sums", "dead")
_SUM_SEED = np.uint64(0x9E3779B97F4A7C15)
_SUM_MUL = np.uint64(0xFF51AFD7ED558CCD)

#: the block checksum segments are written with (snapshot format 3 on)
BLOCK_CHECKSUM = "xxh3_64"
#: the block checksum of segments written before it (format 2, where SegmentInfo names none):
#: only verified, never written
LEGACY_BLOCK_CHECKSUM = "mulxor4"

# The syscall that preallocates a segment's rows and keys, named so a test can make it fail.
_allocate = os.posix_fallocate


def block_checksums(blocks: np.ndarray, algorithm: str = BLOCK_CHECKSUM) -> np.ndarray:
    """blocks: (k, block_bytes) uint8, C-contiguous rows -> (k,) uint64, each block's checksum
    under ``algorithm`` (BLOCK_CHECKSUM: XXH3-64, seed 0, of its bytes; LEGACY_BLOCK_CHECKSUM:
    ``legacy_block_sums``). 0.3-1 us a 4 KiB block on one core (bench_ssd: 4-13 GB/s, as the
    legacy sum): tens of times a disk's random-read rate."""
    k = blocks.shape[0]
    if algorithm == BLOCK_CHECKSUM:
        return np.fromiter(map(xxhash.xxh3_64_intdigest, blocks), np.uint64, k)
    if algorithm == LEGACY_BLOCK_CHECKSUM:
        out = np.empty(k, np.uint64)
        legacy_block_sums(blocks.view(np.uint64), out)
        return out
    raise ValueError(f"unknown block checksum {algorithm!r}")


@njit(cache=True, nogil=True)
def legacy_block_sums(words, out):
    """out[b]: the hand-made checksum of block b that segments of snapshot format 2 carry (kept
    only to verify those: it misses flips of bits 41-63 in every fourth 64-bit word). words: (k,
    block_bytes // 8) uint64, the blocks; out: (k,) uint64."""
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
    #: the function of its block checksums (BLOCK_CHECKSUM or LEGACY_BLOCK_CHECKSUM)
    block_checksum: str = BLOCK_CHECKSUM

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, block_checksum: str | None = None) -> "SegmentInfo":
        """The entry ``d`` of slots.json; ``block_checksum``: the checksum of an entry that
        names none (format 2: LEGACY_BLOCK_CHECKSUM; None: the entry must name it)."""
        try:
            info = cls(**{k: int(d[k]) for k in cls.__dataclass_fields__
                          if k in d and k != "block_checksum"},
                       block_checksum=d["block_checksum"] if block_checksum is None
                       else d.get("block_checksum", block_checksum))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise SnapshotError(f"a segment entry {d!r} is malformed ({e!r})") from None
        if info.block_checksum not in (BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM):
            raise SnapshotError(
                f"segment {info.id:016x} has block checksums of kind {info.block_checksum!r}, "
                f"which this library does not read (it reads {BLOCK_CHECKSUM!r} and "
                f"{LEGACY_BLOCK_CHECKSUM!r}): load it with the version that wrote it")
        return info


class Segment:
    """One segment of the live table. ``index``: its number in the directory's location space
    (location = index * pool.segment_rows + slot); ``keys``: (n_slots,) uint64, read-only, from
    the keys file (``append_keys`` extends it while active); ``sums``: (blocks,) uint64, the
    block checksums (``checksum`` names their function); ``live``: slots still current."""

    def __init__(self, pool: "SegmentPool", seg_id: int, index: int, fd: int, direct: bool,
                 sealed: bool, n_slots: int, owned: bool, capacity: int, checksum: str,
                 folder: str):
        self.pool, self.id, self.index, self.folder = pool, seg_id, index, folder
        self._fd, self.direct = fd, direct  # the rows file: open on demand (``fd()``)
        self._writable = not sealed
        self.sealed, self.n_slots, self.owned = sealed, n_slots, owned
        self._keys = MappedWords(self.path("keys"), n_slots, pool.handles)
        self.capacity = capacity  # slots it may hold (<= pool.segment_rows)
        self.checksum = checksum
        self.live = 0
        self.dead: list[tuple[int, int]] = []  # tombstones (key, position), active only
        self.info: SegmentInfo | None = None   # set once sealed
        self.rows_crc = 0          # CRC32 of the blocks that will not change again
        self.crc_blocks = 0        # ... how many of them (a prefix of the file)
        self.tail = None           # bytes of the partly filled last block (active only)
        self._sums_ram = np.empty(0, np.uint64)  # block checksums while active ...
        self._sums_map: MappedWords | None = None  # ... and mapped once sealed
        self.keys_fd = None        # the keys file, open for appending while active

    @property
    def base(self) -> int:
        return self.index * self.pool.segment_rows

    @property
    def keys(self) -> np.ndarray:
        """(n_slots,) uint64, read-only."""
        return self._keys.array()[:self.n_slots]

    @property
    def sums(self) -> np.ndarray:
        return self._sums_ram if self._sums_map is None else self._sums_map.array()

    def append_keys(self, keys: np.ndarray) -> None:
        """keys: (m,) uint64 of the rows about to be written at slots n_slots..n_slots+m-1
        (written first: a failure leaves the segment as it was, a StoreError). The file is
        preallocated to ``capacity`` slots and mapped so once, until the seal cuts it."""
        start = self.n_slots
        try:
            if self._keys.n < self.capacity:  # a failed seal cut it: allocate it again
                _allocate(self.keys_fd, 0, 8 * self.capacity)
                old, self._keys = self._keys, MappedWords(self.path("keys"), self.capacity,
                                                          self.pool.handles)
                old.unmap()
            data = np.ascontiguousarray(keys, np.uint64).tobytes()
            done = 0
            while done < len(data):
                done += os.pwrite(self.keys_fd, data[done:], 8 * start + done)
        except OSError as e:
            # slots from n_slots on are not the segment's yet: nothing it holds changed
            raise StoreError(write_failed("writing the keys of", self.path("keys"), e,
                                          "write the rows again")) from None

    def cut_keys(self) -> None:
        """Cut the keys file to the slots written (sealing) and map just those. The mapping of
        the slots written comes first: after an interrupt anywhere here ``_keys.n`` is below
        ``capacity`` whenever the file may be cut, so ``append_keys`` allocates it again."""
        old, self._keys = self._keys, MappedWords(self.path("keys"), self.n_slots,
                                                  self.pool.handles)
        old.unmap()  # (mapped lazily: nothing maps the file past its cut)
        os.ftruncate(self.keys_fd, 8 * self.n_slots)

    def fd(self) -> int:
        """The rows file's descriptor, opened again if the budget closed it (a caller that
        needs several at once uses ``SegmentPool.open_rows``)."""
        return self.pool.open_rows([self])[0]

    def close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.pool.handles.file_closed(self)

    def path(self, kind: str) -> str:
        """Its file of ``kind`` (in ``folder``: the pool's, or a foreign snapshot's pool)."""
        return self.pool.path(self.id, kind, self.folder)

    def check_rows_size(self, needed: int) -> None:
        """Raise StoreError naming the rows file if it holds fewer than ``needed`` bytes."""
        size = os.fstat(self.fd()).st_size
        if size < needed:
            raise short_file_error(self.path("rows"), size, needed)

    def close(self) -> None:
        self.close_fd()
        if self.keys_fd is not None:
            os.close(self.keys_fd)
            self.keys_fd = None
        self._keys.unmap()
        if self._sums_map is not None:
            self._sums_map.unmap()
        self._sums_ram, self._sums_map = np.empty(0, np.uint64), None


class SegmentPool:
    """The pool folder and the layout of the segments in it."""

    def __init__(self, folder: str, line_size: int, physical_block_size: int, segment_rows: int,
                 direct: bool = True):
        self.folder = folder
        self.line_size = int(line_size)
        self.rows_per_block, self.block_bytes = block_layout(self.line_size, physical_block_size)
        self.segment_rows = int(segment_rows)
        self.direct = direct
        #: the block checksum of the segments it creates (LEGACY_BLOCK_CHECKSUM only to write
        #: segments as format 2 did, for tests and benchmarks of old snapshots)
        self.block_checksum = BLOCK_CHECKSUM
        #: the rows files kept open and the keys / checksum files kept mapped
        self.handles = HandleBudget()
        os.makedirs(folder, exist_ok=True)

    # -- layout -----------------------------------------------------------------------------
    def adopt(self, rows_per_block: int, block_bytes: int, segment_rows: int) -> None:
        """Take another layout (a loaded snapshot's): new segments are written like its own."""
        self.rows_per_block, self.block_bytes = int(rows_per_block), int(block_bytes)
        self.segment_rows = int(segment_rows)

    def open_rows(self, segs) -> list[int]:
        """The rows file descriptors of ``segs`` (Segments), all open together: closed ones are
        opened again, and the budget closes the least recently used others beyond its bound."""
        out = []
        for seg in segs:
            if seg._fd is None:
                path = seg.path("rows")
                try:
                    seg._fd, _ = open_block_file(path, os.O_RDWR if seg._writable
                                                 else os.O_RDONLY, seg.direct)
                except OSError as e:
                    raise StoreError(f"cannot open segment {path!r} ({e.strerror or e}): another "
                                     "process removed it? Load another snapshot") from None
            out.append(seg._fd)
        self.handles.file_used(segs)
        return out

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
        (a full disk fails here, before any row moves). Whatever stops it (an OSError, or a
        KeyboardInterrupt anywhere), nothing of the segment stays behind: neither its
        descriptors nor its files. The caller never asks twice for one ``seg_id``."""
        path = self.path(seg_id, "rows")
        try:
            fd, direct = open_block_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.direct,
                                         warn_as=self.folder)
        except OSError as e:
            if e.errno == errno.EEXIST:
                raise StoreError(
                    f"cannot create the segment {path!r}: a file of that name exists already "
                    "(another process or store writes segments into the same folder? give each "
                    "its own persistent_path)") from None
            raise too_many_open_files(path, e) or StoreError(
                f"cannot create the segment {path!r} ({e.strerror or e}): give a "
                "persistent_path this process can write") from None
        keys_path = self.path(seg_id, "keys")
        keys_fd = seg = None
        try:
            _allocate(fd, 0, self.blocks_for(capacity) * self.block_bytes)
            if direct and not check_alignment(fd, self.block_bytes):
                os.close(fd)
                fd = None       # closed: an error opening it again must not close it twice
                fd = os.open(path, os.O_RDWR)
                direct = False
                warn_buffered(self.folder, f"O_DIRECT refuses {self.block_bytes}-byte blocks here")
            keys_fd = os.open(keys_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            _allocate(keys_fd, 0, 8 * capacity)
            seg = Segment(self, seg_id, index, fd, direct, False, 0, True, capacity,
                          self.block_checksum, self.folder)
            seg._sums_ram = np.zeros(self.blocks_for(capacity), np.uint64)
            seg.keys_fd = keys_fd
            seg._keys = MappedWords(keys_path, capacity, self.handles)
            self.handles.file_used([seg])
        except BaseException as e:
            if seg is not None:
                seg.close()  # its descriptors (and the budget's note of them)
            else:
                for d in (fd, keys_fd):
                    if d is not None:
                        os.close(d)
            for p in (path, keys_path):  # (the rows file is ours: O_EXCL; so is the id)
                try:
                    os.unlink(p)
                except OSError:  # never made, or not a file (EISDIR): nothing of ours there
                    pass
            if not isinstance(e, OSError):
                raise
            raise too_many_open_files(path, e) or StoreError(write_failed(
                "allocating the segment", path, e, "train on or save again (or move "
                "persistent_path to a bigger disk); the rows held so far are unchanged")) from None
        self.direct = direct
        return seg

    def seal(self, seg: Segment) -> SegmentInfo:
        """Make ``seg`` immutable and durable: its rows file cut to the blocks used and synced,
        its keys (and tombstones) written and synced. Returns what a snapshot records of it.

        Two steps, each safe to run again after an interrupt anywhere in it: the files (until
        ``seg.info`` is set, the segment is active and whole: anything that stops this step
        leaves it so, to be sealed again), then the switch of ``seg`` to sealed, which only
        reads ``seg.info``. A segment whose ``info`` is set takes no more rows: the caller
        finishes the seal (calls this again) before it writes."""
        if seg.info is None:
            self._seal_files(seg)
        return self._finish_seal(seg)

    def _seal_files(self, seg: Segment) -> None:
        n_blocks = self.blocks_for(seg.n_slots)
        rows_crc = seg.rows_crc  # the segment's own only once every write below succeeded
        if seg.tail is not None:  # the partly filled last block is final now
            rows_crc = zlib.crc32(seg.tail, rows_crc)
        sums = np.ascontiguousarray(seg.sums[:n_blocks])
        dead = np.array(seg.dead, np.uint64).reshape(-1, 2)
        fd = seg.fd()
        # the files that take space first: a full disk fails before the rows and keys files
        # are cut, so the segment stays active, preallocated and whole (seal it again later)
        _write_synced(self.path(seg.id, "sums"), sums.tobytes())
        if dead.shape[0]:
            _write_synced(self.path(seg.id, "dead"), dead.tobytes())
        os.ftruncate(fd, n_blocks * self.block_bytes)
        os.fdatasync(fd)
        seg.cut_keys()
        os.fsync(seg.keys_fd)
        keys_crc = zlib.crc32(seg.keys[:seg.n_slots]) if seg.n_slots else 0
        fsync_dir(self.folder)
        # the one assignment that makes it sealed (what follows only reads it)
        seg.info = SegmentInfo(seg.id, seg.n_slots, n_blocks * self.block_bytes, rows_crc,
                               keys_crc, zlib.crc32(sums.tobytes()),
                               int(dead.shape[0]),
                               zlib.crc32(dead.tobytes()) if dead.shape[0] else 0,
                               seg.checksum)

    def _finish_seal(self, seg: Segment) -> SegmentInfo:
        """The RAM side of a seal whose files are written (``seg.info`` set): idempotent."""
        info = seg.info
        n_blocks = info.rows_bytes // self.block_bytes
        seg.rows_crc, seg.crc_blocks = info.rows_crc32, n_blocks
        seg.sealed, seg.tail, seg.dead = True, None, []
        if seg.keys_fd is not None:
            fd = seg.keys_fd
            seg.keys_fd = None  # first: an interrupt may leak it, never close it twice
            os.close(fd)
        if seg._sums_map is None:
            seg._sums_map = MappedWords(self.path(seg.id, "sums"), n_blocks, self.handles)
        seg._sums_ram = None
        return info

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
                fd, direct = os.open(path, os.O_RDONLY), False
                warn_buffered(self.folder, f"O_DIRECT refuses {self.block_bytes}-byte blocks here")
        except OSError as e:
            if fd is not None:
                os.close(fd)
            raise too_many_open_files(path, e) or SnapshotError(
                f"cannot open segment {info.id:016x} in {folder!r} ({e}): damaged or "
                "incomplete") from None
        seg = Segment(self, info.id, index, fd, direct, True, info.slots, owned, info.slots,
                      info.block_checksum, folder)
        seg._sums_map = MappedWords(self.path(info.id, "sums", folder),
                                    info.rows_bytes // self.block_bytes, self.handles)
        seg._sums_ram = None
        seg.info = info
        self.handles.file_used([seg])
        return seg

    def read_dead(self, info: SegmentInfo, folder: str) -> np.ndarray:
        """The tombstones (m, 2) uint64 of a sealed segment."""
        if not info.dead:
            return np.empty((0, 2), np.uint64)
        path = self.path(info.id, "dead", folder)
        words = np.fromfile(path, np.uint64, 2 * info.dead)
        if words.shape[0] < 2 * info.dead:
            raise short_file_error(path, 8 * words.shape[0], 16 * info.dead)
        return words.reshape(-1, 2)

    def delete(self, seg_id: int) -> None:
        for kind in KINDS:
            try:
                os.unlink(self.path(seg_id, kind))
            except FileNotFoundError:
                pass


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
