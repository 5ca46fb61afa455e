"""``one-embedding inspect``: what a table path's snapshots hold (rows, dims, counters).

Each snapshot is reopened through the engine that wrote it (named in its manifest) in a scratch
folder, so the rows printed are the rows a ``load_snapshot`` would restore. Unlike a load, which
checks what a snapshot shares with others (SSTs, slot segments) by size and key checksums only,
inspect reads every byte against its CRC32 (``quick=True``: as a load does). A snapshot that
fails its checks (a damaged manifest, a file failing its checksum) is listed with ``"status":
"damaged"`` and the reason, and the others are still inspected: one bad folder must not hide the
good ones a user would fall back to. Each is read under a lease, so the training process that
owns the path may delete it meanwhile without pulling its files from under the reader.
"""
from __future__ import annotations

import os
import tempfile
import textwrap

import numpy as np

from .chain import open_store_for_snapshot
from .errors import SnapshotError, StoreError
from .store.snapshots import MANIFEST, NewerFormatError, SnapshotDirectory, lease


def _snapshot_roots(path: str) -> list[str]:
    if os.path.isdir(os.path.join(path, "snapshots")):
        return [path]
    roots = sorted(os.path.join(path, d) for d in os.listdir(path)
                   if os.path.isdir(os.path.join(path, d, "snapshots"))) if os.path.isdir(path) else []
    if not roots:
        if not os.path.exists(path):
            raise SnapshotError(f"{path!r} does not exist: pass a run's --persistent-path")
        if not os.path.isdir(path):
            raise SnapshotError(f"{path!r} is a file: pass a run's --persistent-path folder")
        raise SnapshotError(f"{path!r} holds no snapshots/ folder (nor <rank>-<world>/snapshots/)")
    return roots


def inspect_path(path: str, name: str | None = None, rows: int = 3,
                 quick: bool = False) -> list[dict]:
    """One dict per snapshot under ``path`` (or only ``name``): ``"status"`` "ok" with its
    manifest fields and ``rows`` sample lines, "damaged" with ``"error"`` saying why, or
    "newer" (written by a newer one_embedding, in a format this version does not read).
    quick: check shared data by size and key checksums only (as a load does), not every byte."""
    out = []
    for root in _snapshot_roots(path):
        snaps = SnapshotDirectory(root, create=False)
        for snap in [name] if name else _published(snaps):
            try:
                out.append(_inspect_one(root, snaps, snap, rows, quick))
            except NewerFormatError as e:  # not damage: nothing this version can check
                out.append({"path": root, "snapshot": snap, "status": "newer", "error": str(e)})
            except SnapshotError as e:
                if name and not os.path.isdir(snaps.path(name)):
                    raise  # no such snapshot: a usage error, not damage
                out.append({"path": root, "snapshot": snap, "status": "damaged", "error": str(e)})
            except StoreError as e:  # the engine could not read files that passed the checks
                out.append({"path": root, "snapshot": snap, "status": "damaged", "error": str(e)})
    return out


def _published(snaps: SnapshotDirectory) -> list[str]:
    """Every snapshot folder: ``names()`` plus folders that lost their manifest (a published
    snapshot always has one, so those are damaged, and reported; ``.tmp-`` and ``.old-``
    folders are unfinished work, not snapshots)."""
    return sorted(e for e in os.listdir(snaps.root)
                  if not e.startswith(".") and os.path.isdir(snaps.path(e)))


def _inspect_one(root: str, snaps: SnapshotDirectory, snap: str, rows: int, quick: bool) -> dict:
    manifest_path = os.path.join(snaps.path(snap), MANIFEST)
    if os.path.isdir(snaps.path(snap)) and not os.path.isfile(manifest_path):
        raise SnapshotError(f"snapshot {snap!r}: {manifest_path} is missing, so nothing in the "
                            "folder can be checked; load another snapshot")
    folder, manifest = snaps.open(snap, {}, verify=True if quick else "full")
    line = int(manifest["line_size"])
    e = int(sum(manifest["embedding_dims"] or [line]))  # a table writer may not record columns
    stored = line + int(manifest.get("lifecycle_columns", 0))  # + last-seen step, frequency
    with lease(folder), tempfile.TemporaryDirectory() as scratch:
        store = open_store_for_snapshot(manifest["engine"], stored, scratch)
        legacy = _legacy_slots(manifest, folder)
        try:
            if not legacy:
                store.verify_snapshot(folder, full=not quick)
            store.load_snapshot(folder)
            keys, lines = next(store.export_batches(max(1, rows)),
                               (np.empty(0, np.uint64), np.empty((0, stored))))
            # a format-1 slots snapshot shares nothing: its rows are in its folder
            referenced = 0 if legacy else store.referenced_bytes(folder)
        finally:
            store.close()
    sample = [{"key": int(k), "embedding": np.round(v[:e], 6).tolist(),
               "state": np.round(v[e:line], 6).tolist(),
               **({"last_seen_step": int(v[line:line + 1].view(np.int32)[0]),
                   "frequency": float(v[line + 1])} if stored > line else {})}
              for k, v in zip(keys[:rows], lines[:rows])]
    return {
        "path": root, "snapshot": snap, "status": "ok",
        **{k: manifest.get(k) for k in ("embedding_name", "store_kind", "engine", "key_type",
                                        "embedding_dims", "line_size", "row_count",
                                        "created_unix", "store_stats", "lifecycle")},
        "lifecycle_columns": stored - line,
        **({"slots_format": 1} if legacy else {}),  # read as loads read it
        "bytes_on_disk": _tree_bytes(folder) + referenced,
        "rows": sample,
    }


def _legacy_slots(manifest: dict, folder: str) -> bool:
    """Whether ``folder`` holds a slots snapshot of format 1 (``layout.json``, ``keys.npy``,
    ``slots.npy`` and a copy of ``rows.bin``; no ``slots.json``), which loads read (copying its
    rows into segments). It shares no segment, so the manifest's CRC32s of its own files (checked
    by ``SnapshotDirectory.open``) cover all its data, and the engine's own checks of shared
    segments (``verify_snapshot``, ``referenced_bytes``, which read slots.json) have nothing to
    check."""
    return manifest.get("engine") == "ssd.slots" and \
        not os.path.isfile(os.path.join(folder, "slots.json")) and \
        os.path.isfile(os.path.join(folder, "layout.json"))


def _tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # not reached


def _ram_bytes(snapshot: dict) -> int | None:
    """The training store's RAM when the snapshot was taken: every tier's memory_bytes."""
    stats = snapshot.get("store_stats") or []
    values = [t.get("memory_bytes") for t in stats if isinstance(t, dict)]
    return int(sum(values)) if values and all(v is not None for v in values) else None


def format_inspection(found: list[dict]) -> str:
    """``inspect_path``'s result for a person: per folder one line per snapshot (status, rows,
    bytes on disk and per row, the store's RAM per key when it was taken, engine, time), then
    what a line holds and what the RAM per key counts. ``--json`` prints ``found`` itself."""
    import datetime

    header = ("snapshot", "status", "rows", "on disk", "disk/row", "RAM/key", "engine",
              "created (UTC)")
    lines, lines_of, ram_shown = [], {}, False
    for path in dict.fromkeys(s["path"] for s in found):
        table = [header]
        errors = []
        for s in (s for s in found if s["path"] == path):
            if s["status"] != "ok":
                table.append((s["snapshot"], s["status"], "-", "-", "-", "-", "-", "-"))
                errors.append(f"  {s['snapshot']}: {s['error']}")
                continue
            rows = int(s.get("row_count") or 0)
            ram = _ram_bytes(s)
            ram_shown |= ram is not None and rows > 0
            created = s.get("created_unix")
            when = (datetime.datetime.fromtimestamp(created, datetime.timezone.utc)
                    .strftime("%Y-%m-%d %H:%M:%S") if created else "-")
            table.append((s["snapshot"], "ok", f"{rows:,}", _size(s["bytes_on_disk"]),
                          _size(s["bytes_on_disk"] / rows) if rows else "-",
                          _size(ram / rows) if ram is not None and rows else "-",
                          str(s.get("engine") or "-"), when))
            dims = s.get("embedding_dims") or []
            lines_of[(sum(dims) if dims else None, s["line_size"],
                      int(s.get("lifecycle_columns") or 0))] = s.get("store_kind")
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        count = len(table) - 1
        lines.append(f"{path}: {count} snapshot{'s' if count != 1 else ''}")
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in table]
        lines += errors
    for (embedding, line, meta), _ in lines_of.items():
        stored = line + meta   # the lifecycle's last-seen step and frequency ride behind the line
        parts = ([f"{line - embedding} floats of optimizer state"]
                 if embedding is not None and embedding != line else []) + \
            ([f"{meta} of the lifecycle (last-seen step, frequency)"] if meta else [])
        what = f": the {embedding or line}-float embedding, " + ", ".join(parts) if parts else ""
        lines.append(f"A key's line: {stored} floats ({4 * stored} B){what}.")
    if ram_shown:
        lines.append("RAM/key: the training store's memory (every tier: caches, index, I/O "
                     "buffers) when the snapshot was taken, divided by its rows; fixed buffers "
                     "dominate a small table (`one-embedding plan` separates them).")
    lines.append("disk/row: the snapshot's files, shared ones included, divided by its rows. "
                 "--json prints every field and sample rows.")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False)
                     if len(line) > 100 else line for line in lines)
