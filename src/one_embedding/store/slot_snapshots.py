"""The slot engine's snapshots and garbage collection (``SlotFileStore`` inherits them).

A snapshot of the slot engine is ``slots.json`` in the snapshot's folder: the format, the layout
(rows per block, block bytes, segment rows), the pool folder relative to the snapshot (so a path
may move as a whole) and, per live segment in id order, its ``SegmentInfo`` (slots, sizes, CRC32s
of its keys, checksums and tombstones, and of its rows for a full check, and the function of its
block checksums). Format 3 names that function per segment; format 2 (before it) named none, and
its segments carry the legacy checksum, with which they are still verified. Saving seals the active
segment and writes that list. Loading checks every listed segment (sizes, key and checksum CRC32s;
rows only with a full check), opens them where they lie (read only, and never deleted, when they
belong to another path's pool) and replays their key files into a fresh directory. Garbage
collection deletes the segments in the pool that neither the live table nor any folder under
``<directory>/snapshots/`` refers to.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import SnapshotError, StoreError
from ..procstats import return_free_heap
from .durable import read_array, write_bytes_atomic, write_failed
from .segments import LEGACY_BLOCK_CHECKSUM, SegmentInfo

#: a load of at least this many rows hands its rebuild's free heap back (``return_free_heap``)
TRIM_AFTER_ROWS = 1 << 20

LAYOUT_FILE = "slots.json"
#: the format written: 3 names each segment's block checksum
FORMAT = 3
#: formats read, with the block checksum of a segment entry that names none (None: required)
READ_FORMATS = {2: LEGACY_BLOCK_CHECKSUM, 3: None}


class SlotSnapshots:
    """Snapshot and garbage-collection methods of ``SlotFileStore`` (it provides the pool, the
    directory, the live segments and their bookkeeping)."""

    # -- garbage collection ---------------------------------------------------------------
    def _pinned_ids(self) -> set[int]:
        """Segment ids that a folder under ``<directory>/snapshots/`` refers to."""
        ids: set[int] = set()
        for folder in self._snapshots.folders():
            path = os.path.join(folder, LAYOUT_FILE)
            try:
                with open(path, "rb") as f:
                    layout = json.loads(f.read())
                if os.path.realpath(os.path.join(folder, layout["pool"])) == \
                        os.path.realpath(self.pool.folder):
                    ids.update(int(s["id"]) for s in layout["segments"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no layout (another engine, or half written: not published)
        return ids

    def collect_garbage(self) -> int:
        """Delete the segment files that neither the live table nor a snapshot folder (deleted
        ones a reader still leases included) refers to. Returns how many segments went."""
        if os.path.isdir(self._snapshots.root):
            self._snapshots.reap_deleted()
        keep = self._pinned_ids() | {s.id for s in self._segments.values() if s.owned}
        doomed = self.pool.ids_on_disk() - keep
        for seg_id in sorted(doomed):
            self.pool.delete(seg_id)
        self.io_counts["deleted_segments"] += len(doomed)
        return len(doomed)

    # -- snapshots ------------------------------------------------------------------------
    def _check_snapshot_folder(self, directory: str) -> None:
        parent = os.path.realpath(os.path.dirname(os.path.abspath(directory)))
        if parent != os.path.realpath(self._snapshots.root):
            raise SnapshotError(
                f"{self.name}: a snapshot of this store shares its segments, so it must live in "
                f"{self._snapshots.root!r} (where garbage collection sees it), not in "
                f"{os.path.dirname(os.path.abspath(directory))!r}")

    def save_snapshot(self, directory: str) -> None:
        self._check()
        self._check_snapshot_folder(directory)
        try:
            self._seal_active()
            live = sorted(self._segments.values(), key=lambda s: s.id)
            for seg in live:
                if seg.info is None or not seg.sealed:
                    # unsealed yet not active: left by an interrupt (a KeyboardInterrupt between
                    # two steps of a clear or a load); sealing it is right whatever it holds
                    self.pool.seal(seg)
            layout = {"engine": "slots", "format": FORMAT, "line_size": self.line_size,
                      "rows": len(self._index), "rows_per_block": self.pool.rows_per_block,
                      "block_bytes": self.pool.block_bytes,
                      "segment_rows": self.pool.segment_rows,
                      "pool": os.path.relpath(self.pool.folder, directory),
                      "segments": [s.info.as_dict() for s in live]}
            write_bytes_atomic(os.path.join(directory, LAYOUT_FILE), json.dumps(layout).encode())
        except OSError as e:
            raise StoreError(f"{self.name}: " + write_failed(
                "writing snapshot files into", directory, e,
                "save again (the previous snapshot of that name is intact too)")) from None

    def verify_snapshot(self, directory: str, full: bool = False) -> None:
        """Raise SnapshotError unless every segment the snapshot in ``directory`` lists is there
        with its sizes and key CRC32s (``full``: the CRC32 of every row block too)."""
        layout, infos, pool_dir = self._read_layout(directory)
        for info in infos:
            self.pool.check(info, pool_dir, layout["block_bytes"], full)

    def referenced_bytes(self, directory: str) -> int:
        """Bytes of the segment files the snapshot in ``directory`` lists."""
        _, infos, _ = self._read_layout(directory)
        return sum(i.rows_bytes + 8 * i.slots + 16 * i.dead for i in infos)

    def _read_layout(self, directory: str):
        path = os.path.join(directory, LAYOUT_FILE)
        try:
            with open(path, "rb") as f:
                layout = json.loads(f.read())
            if not isinstance(layout, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise SnapshotError(f"{self.name}: snapshot {directory!r} is unreadable: {e}") from None
        fmt = layout.get("format")
        if layout.get("engine") != "slots" or layout.get("line_size") != self.line_size \
                or not isinstance(fmt, int) or fmt not in READ_FORMATS:
            raise SnapshotError(
                f"{self.name}: snapshot {directory!r} has layout "
                f"{ {k: layout.get(k) for k in ('engine', 'format', 'line_size')} }; this store "
                f"needs a 'slots' snapshot of format {' or '.join(map(str, READ_FORMATS))} and "
                f"line_size={self.line_size}")
        try:
            infos = [SegmentInfo.from_dict(d, READ_FORMATS[fmt]) for d in layout["segments"]]
            pool_dir = os.path.normpath(os.path.join(directory, layout["pool"]))
        except (KeyError, TypeError) as e:
            raise SnapshotError(
                f"{self.name}: snapshot {directory!r} is unreadable: {e!r}") from None
        except SnapshotError as e:
            raise SnapshotError(f"{self.name}: snapshot {path!r}: {e}") from None
        return layout, sorted(infos, key=lambda i: i.id), pool_dir

    def load_snapshot(self, directory: str) -> None:
        if not os.path.isfile(os.path.join(directory, LAYOUT_FILE)) and \
                os.path.isfile(os.path.join(directory, "layout.json")):
            return self._load_legacy(directory)
        layout, infos, pool_dir = self._read_layout(directory)
        own = os.path.realpath(pool_dir) == os.path.realpath(self.pool.folder)
        for info in infos:  # refuse a damaged snapshot before the live table changes
            self.pool.check(info, pool_dir, layout["block_bytes"])
        by_id = {s.id: s for s in self._segments.values() if s.sealed and s.owned and own}
        old = [s for s in self._segments.values() if s.id not in {i.id for i in infos} or not own]
        try:  # whatever stops it (a KeyboardInterrupt too), the live table ends up empty
            self._index.clear()
            for seg in old:
                self._forget(seg)
            self._active = None
            self.pool.adopt(layout["rows_per_block"], layout["block_bytes"],
                            layout["segment_rows"])
            self._broken = None
            for info in infos:
                if info.id not in by_id:
                    seg = self.pool.open_sealed(info, self._take_index(), pool_dir, own)
                    self._add(seg)
                    by_id[info.id] = seg
                seg = by_id[info.id]
                seg.live = 0
                self._replay(seg, self.pool.read_dead(info, pool_dir))
        except BaseException:
            self.clear()
            raise
        if len(self._index) != layout["rows"]:
            replayed = len(self._index)
            self.clear()
            raise SnapshotError(f"{self.name}: snapshot {directory!r} replays to {replayed} rows, "
                                f"not the {layout['rows']} it recorded: damaged")
        self._count_live(self._index.locations(), 1)
        self._next_id = max(self._next_id, 1 + max((i.id for i in infos), default=0))
        self.collect_garbage()
        # the replay's temporaries (unique keys, positions per segment) are freed by now: give
        # their pages back, so that RSS after a load is the directory's ~6 B a key, not twice.
        # Only after a large load: malloc_trim walks the whole heap (6-100 ms a call measured)
        if layout["rows"] >= TRIM_AFTER_ROWS:
            return_free_heap()

    def _replay(self, seg, dead: np.ndarray) -> None:
        """Apply the rows of ``seg`` to the directory in slot order (the last row of a key wins)
        and each tombstone ``(key, position)`` before the row at ``position``."""
        start = 0
        for cut in np.unique(dead[:, 1]).tolist():
            self._replay_rows(seg, start, int(cut))
            gone = np.unique(dead[dead[:, 1] == np.uint64(cut), 0])
            self._index.erase_at(self._index.positions(gone, self._keys_of))
            start = int(cut)
        self._replay_rows(seg, start, seg.n_slots)

    def _replay_rows(self, seg, start: int, stop: int) -> None:
        if stop <= start:
            return
        keys = np.asarray(seg.keys[start:stop])
        uniq, last_rev = np.unique(keys[::-1], return_index=True)  # each key's last row
        locs = seg.base + start + (keys.shape[0] - 1 - last_rev)
        self._index.upsert(uniq, locs, self._keys_of)

    def _load_legacy(self, directory: str) -> None:
        """A snapshot of format 1 (``keys.npy`` + ``slots.npy`` + a copy of ``rows.bin``): its
        rows are copied into segments."""
        try:
            with open(os.path.join(directory, "layout.json"), "rb") as f:
                layout = json.loads(f.read())
            keys = read_array(os.path.join(directory, "keys.npy"))
            slots = read_array(os.path.join(directory, "slots.npy"))
        except (OSError, ValueError) as e:
            raise SnapshotError(f"{self.name}: snapshot {directory!r} is unreadable: {e}") from None
        if layout.get("engine") != "slots" or layout.get("line_size") != self.line_size \
                or keys.shape != slots.shape or layout.get("rows") != keys.shape[0]:
            raise SnapshotError(
                f"{self.name}: snapshot {directory!r} has layout {layout} and {keys.shape[0]} "
                f"keys; this store needs a 'slots' snapshot of line_size={self.line_size}")
        src = os.path.join(directory, "rows.bin")
        self.clear()
        rows = np.memmap(src, np.float32, "r")
        rpb, bb = layout["rows_per_block"], layout["block_bytes"]
        view = np.ndarray((os.path.getsize(src) // bb, rpb, self.line_size), np.float32,
                          buffer=rows, strides=(bb, 4 * self.line_size, 4))
        try:
            for start in range(0, keys.shape[0], 1 << 16):
                s = slots[start:start + (1 << 16)]
                self.insert_or_assign(keys[start:start + (1 << 16)],
                                      np.ascontiguousarray(view[s // rpb, s % rpb]))
        except BaseException:
            self.clear()  # (a full disk) an empty table, never a part of the snapshot
            raise
        finally:
            del view, rows

