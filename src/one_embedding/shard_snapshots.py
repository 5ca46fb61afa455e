"""A shard's snapshots: save (flush, then record the bottom tier's rows with a manifest),
delete, load (this world's folder, another engine's rows, or another number of ranks' folders
re-sharded by owner rank), and the checks that refuse a snapshot of another optimizer or
another eviction layout.

``ShardSnapshots`` is a mixin of ``shard.EmbeddingShard``: its methods use the shard's tier chain
(``_chain``), snapshot directory (``_snapshots``), layout, lifecycle, write log and ``_state``
lock, as the shard's docstring describes them.
"""
from __future__ import annotations

import os
import re

import numpy as np

from .chain import read_snapshot_rows
from .errors import SnapshotError
from .parallel.shuffle import owner_rank
from .store.snapshots import SnapshotDirectory, read_manifest


def optimizer_layout(optimizer) -> dict:
    """What a snapshot records of the row optimizer: its name and the states its lines hold."""
    return {"name": type(optimizer).__name__,
            "state_names": list(optimizer.state_names) + list(optimizer.row_columns)}


class ShardSnapshots:
    """The snapshot verbs of ``EmbeddingShard``."""

    def manifest_fields(self) -> dict:
        return {**self.layout.manifest_fields(), "engine": self._chain.bottom.name}

    def bind_optimizer(self, optimizer) -> None:
        """The row optimizer whose state the lines hold, recorded in snapshots; refused when a
        loaded snapshot holds another optimizer's state."""
        layout = optimizer_layout(optimizer)
        self._check_optimizer(self._loaded_optimizer, layout, "the loaded snapshot")
        self._optimizer = layout

    @staticmethod
    def _check_optimizer(saved: dict | None, current: dict | None, where: str) -> None:
        if saved is None or current is None or saved["state_names"] == current["state_names"]:
            return
        raise SnapshotError(
            f"{where} holds {saved['name']} state {saved['state_names']} in its lines but this "
            f"embedding is updated by {current['name']} (state {current['state_names']}): use "
            f"{saved['name']}, or start a new table (another persistent_path)"
        )

    def _require_path(self, what: str) -> SnapshotDirectory:
        if self._snapshots is None:
            raise SnapshotError(f"{what} needs a persistent_path in the store options")
        return self._snapshots

    def save_snapshot(self, name: str, fields: dict, extra_files=None) -> None:
        """Flush every cache level down, then record the rows under snapshots/<name>/ with
        ``fields`` in the manifest. Durable when it returns; a crash midway leaves the previous
        snapshot of that name."""
        snaps = self._require_path("save_snapshot")
        with self._state:
            self._chain.flush()
            manifest = {**self.manifest_fields(), **fields, "row_count": len(self._chain.bottom),
                        "store_kind": self.store_options.kind, "store_stats": self.stats(),
                        "optimizer": self._optimizer}
            if self.layout.meta_size:
                manifest["lifecycle_columns"] = self.layout.meta_size
            manifest["lifecycle"] = self._lifecycle.manifest()

            def write(folder):
                shared = self._chain.save_bottom(folder)
                self._lifecycle.save(folder)
                if extra_files is not None:
                    extra_files(folder)
                return shared

            snaps.save(name, write, manifest)
            snaps.reap_deleted()  # deleted snapshots whose readers have let go since
            self._chain.collect_garbage()  # what a replaced or deleted snapshot alone held

    def delete_snapshot(self, name: str) -> bool:
        """Delete snapshot ``name`` and reclaim the disk only it used. Returns False when a
        reader in another process still holds a lease on it: the name is gone, its files stay
        until the reader lets go (a later save, delete or open reclaims them)."""
        snaps = self._require_path("delete_snapshot")
        with self._state:
            gone = snaps.delete(name)
            snaps.reap_deleted()  # and those earlier deletes left to readers that are done now
            self._chain.collect_garbage()
            return gone

    def load_snapshot(self, name: str, expected: dict, saved_by: int | None = None) -> dict:
        """Clear the caches and restore exactly the rows saved under ``name``; the manifest must
        match ``expected`` and this shard's layout, and hold the state of the bound optimizer.
        Returns the manifest, with ``"folder"``: this rank's snapshot folder (or, re-sharded,
        old rank 0's).

        A snapshot saved by another number of ranks is re-sharded: every rank reads the saved
        rows of all the old ranks and keeps the keys it owns now (``owner_rank``). That needs
        the old ranks' folders ``<persistent_path>/<r>-<P_old>`` visible to every rank (one
        machine, or a shared file system).
        """
        snaps = self._require_path("load_snapshot")
        want = {**expected, **self.layout.manifest_fields()}
        if self._saved_columns(snaps, name) is None:
            # written by a table writer not told its columns (OneFlow's arguments): its lines
            # load into any embedding whose line_size is the writer's storage_dim
            del want["embedding_dims"]
        engine = self.manifest_fields()["engine"]
        if saved_by is not None and saved_by != self.world:
            roots = self._other_world_sources(name, saved_by)
            if not roots:
                raise SnapshotError(f"no complete set of {saved_by} rank folders holds snapshot "
                                    f"{name!r} under {self.store_options.persistent_path!r}")
            return self._import_snapshot(name, roots, want)
        if name in snaps.names() and snaps.open(name, want, verify=False)[1]["engine"] != engine:
            # written by another engine (or by a table writer): read row by row
            return self._import_snapshot(name, [self.path], want)
        if name in snaps.names() or not self._other_world_sources(name):
            folder, manifest = snaps.open(name, {**want, "engine": engine})
            self._check_saved(manifest, name)
            with self._state:
                self._forget_lookups()
                self._chain.load_snapshot(folder)
                self._load_lifecycle([(folder, manifest)], resharded=False)
            self._loaded_optimizer = manifest.get("optimizer")
            return {**manifest, "folder": folder}
        return self._import_snapshot(name, self._other_world_sources(name), want)

    def _import_snapshot(self, name: str, roots: list[str], want: dict) -> dict:
        """Load snapshot ``name`` from the rank folders ``roots`` row by row, keeping the keys
        this rank owns: a snapshot of another number of ranks, or of another engine."""
        opened = [SnapshotDirectory(root, create=False).open(name, want) for root in roots]
        for _, manifest in opened:
            self._check_saved(manifest, name)
        with self._state:
            self._forget_lookups()
            self._chain.clear()
            for folder, manifest in opened:
                for keys, lines in read_snapshot_rows(folder, manifest["engine"],
                                                      self.layout.stored_size):
                    mine = owner_rank(keys, self.world) == self.rank
                    if mine.any():
                        self._chain.restore(keys[mine], lines[mine])
            self._load_lifecycle(opened, resharded=roots != [self.path])
        self._loaded_optimizer = opened[0][1].get("optimizer")
        return {**opened[0][1], "folder": opened[0][0]}

    def _check_saved(self, manifest: dict, name: str) -> None:
        """Refuse snapshot ``name`` (its ``manifest``) when its lines hold another optimizer's
        state or another eviction layout than this shard's."""
        self._check_optimizer(manifest.get("optimizer"), self._optimizer, f"snapshot {name!r}")
        self._check_lifecycle_columns(manifest, name)

    def _forget_lookups(self) -> None:
        """Before a load replaces the rows (caller holds ``_state``): every outstanding lookup's
        lines become stale (a new generation) and the write log, which patches them, is
        dropped (its entries kept until the device has read them)."""
        self._generation += 1
        self._retired.retire(self._log)
        self._log.clear()

    def _saved_columns(self, snaps: SnapshotDirectory, name: str):
        """The ``embedding_dims`` snapshot ``name`` records (here, or in the old ranks' folders
        of another world); [] when there is no readable manifest (the load then says why)."""
        folders = [snaps.path(name)] if name in snaps.names() else \
            [SnapshotDirectory(root, create=False).path(name)
             for root in self._other_world_sources(name)[:1]]
        for folder in folders:
            try:
                return read_manifest(folder, name).get("embedding_dims", [])
            except SnapshotError:
                return []
        return []

    def _check_lifecycle_columns(self, manifest: dict, name: str) -> None:
        saved = int(manifest.get("lifecycle_columns", 0))
        if saved != self.layout.meta_size:
            have = "with" if saved else "without"
            fix = ("turn eviction on (steps_to_live or max_rows) to load it"
                   if saved else "turn eviction off (steps_to_live=0, max_rows=0) to load it")
            raise SnapshotError(
                f"snapshot {name!r} was saved {have} eviction's per-row columns (last-seen step, "
                f"frequency: lifecycle_columns={saved}) but this embedding has "
                f"lifecycle_columns={self.layout.meta_size}: {fix}, or start a new table")

    def _load_lifecycle(self, sources: list, resharded: bool) -> None:
        """After a load (caller holds ``_state``): the lifecycle's sketch and counters from the
        snapshot, and the row count from the store."""
        self._lifecycle.load(sources, resharded, takes_counters=self.rank == 0)
        self._rows = len(self._chain)
        self._new_rows_on_device = None  # counted rows of the table the load replaced

    def _other_world_sources(self, name: str, world: int | None = None) -> list[str]:
        """The rank folders ``<base>/<r>-<P>`` of the newest complete set (every r of some P
        other than this world; of ``world`` ranks when given) that hold snapshot ``name``; []
        when there is none."""
        base = self.store_options.persistent_path
        if not isinstance(base, (str, os.PathLike)) or not os.path.isdir(base):
            return []
        by_world: dict[int, dict[int, str]] = {}
        for entry in os.listdir(base):
            m = re.fullmatch(r"(\d+)-(\d+)", entry)
            folder = os.path.join(base, entry)
            if m and int(m.group(2)) != self.world and world in (None, int(m.group(2))) and \
                    name in SnapshotDirectory(folder, create=False).names():
                by_world.setdefault(int(m.group(2)), {})[int(m.group(1))] = folder
        complete = [(max(os.path.getmtime(f) for f in ranks.values()), world, ranks)
                    for world, ranks in by_world.items() if sorted(ranks) == list(range(world))]
        if not complete:
            return []
        _, world, ranks = max(complete)
        return [ranks[r] for r in range(world)]

    def snapshot_names(self) -> list[str]:
        return self._require_path("snapshot_names").names()


def complete_set(comm, shard, name: str) -> int | None:
    """The number of ranks whose snapshot ``name`` every rank of ``comm`` loads (a collective
    call): None (this world's own, or, where none of its ranks has it, the newest other set as
    each rank finds it) when all or none of this world's ranks hold it; where only some do (a
    run stopped while it saved), the newest other complete set's, else SnapshotError on every
    rank naming the ranks that lack it."""
    held = np.zeros(comm.world, np.float64)
    held[comm.rank] = float(name in shard.snapshot_names())
    held = np.asarray(comm.allreduce_sum(held))
    if held.all() or not held.any():
        return None
    other = shard._other_world_sources(name)
    if other:
        return len(other)
    lacking = [r for r in range(comm.world) if not held[r]]
    raise SnapshotError(
        f"snapshot {name!r} is incomplete at {comm.world} ranks: rank(s) {lacking} lack it (a "
        "run stopped while it saved?), and no complete set of another number of ranks holds "
        "it; load another snapshot (snapshot_names() lists them)")
