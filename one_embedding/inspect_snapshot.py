"""``one-embedding inspect``: what a table path's snapshots hold (rows, dims, counters).

Each snapshot is reopened through the engine that wrote it (named in its manifest) in a scratch
folder, so the rows printed are the rows a ``load_snapshot`` would restore.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from .errors import SnapshotError
from .store.snapshots import SnapshotDirectory


def _snapshot_roots(path: str) -> list[str]:
    if os.path.isdir(os.path.join(path, "snapshots")):
        return [path]
    roots = sorted(os.path.join(path, d) for d in os.listdir(path)
                   if os.path.isdir(os.path.join(path, d, "snapshots"))) if os.path.isdir(path) else []
    if not roots:
        raise SnapshotError(f"{path!r} holds no snapshots/ folder (nor <rank>-<world>/snapshots/)")
    return roots


def _open_bottom(engine: str, line_size: int, folder: str, scratch: str):
    from .cache.full import FullCache

    if engine.endswith(".full"):
        return FullCache(line_size, name=engine)
    if engine == "ssd.slots":
        from .store.slot_file import SlotFileStore

        with open(os.path.join(folder, "layout.json")) as f:
            layout = json.load(f)
        return SlotFileStore(line_size, scratch, layout.get("physical_block_size", 4096), threads=1)
    if engine == "ssd.rocksdb":
        from .store.rocksdb_store import RocksDBStore

        return RocksDBStore(line_size, scratch, threads=1)
    raise SnapshotError(f"unknown engine {engine!r} in the manifest")


def inspect_path(path: str, name: str | None = None, rows: int = 3) -> list[dict]:
    out = []
    for root in _snapshot_roots(path):
        snaps = SnapshotDirectory(root)
        for snap in [name] if name else snaps.names():
            folder, manifest = snaps.open(snap, {}, verify=True)
            dims = manifest["embedding_dims"]
            e = int(sum(dims))
            with tempfile.TemporaryDirectory() as scratch:
                tier = _open_bottom(manifest["engine"], manifest["line_size"], folder, scratch)
                try:
                    tier.load_snapshot(folder)
                    keys = np.load(os.path.join(folder, "keys.npy"))[:rows]
                    found, lines = tier.find(keys)
                finally:
                    tier.close()
            sample = [{"key": int(k), "embedding": np.round(line[:e], 6).tolist(),
                       "state": np.round(line[e:], 6).tolist()}
                      for k, line in zip(keys[found], lines)]
            out.append({
                "path": root, "snapshot": snap,
                **{k: manifest.get(k) for k in ("embedding_name", "store_kind", "engine", "key_type",
                                                "embedding_dims", "line_size", "row_count",
                                                "created_unix", "store_stats")},
                "bytes_on_disk": _tree_bytes(folder),
                "rows": sample,
            })
    return out


def _tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
