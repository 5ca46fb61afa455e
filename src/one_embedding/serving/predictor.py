"""``Predictor``: a training run's newest (or a named) checkpoint, served read-only in-process.

    p = Predictor("runs/t")                       # the newest checkpoint every rank holds
    rows = p.lookup(np.array([3, 17]))            # (2, embedding_dim) float32
    prob = p.predict(dense, categorical)          # (n,) click probabilities from raw features

It never takes the training path's LOCK and never writes under it: each rank folder's snapshot
is read where it lies (``table.ServedTable``), the model's dense weights and the feature
transform come from the checkpoint's ``trainer/`` files. ``refresh()`` switches to a newer
complete checkpoint (training publishes one per ``--snapshot-interval``); the switch is atomic:
a call is answered wholly by the snapshot it started with, and an old snapshot is closed (its
lease let go, so the run's retention can reclaim it) once its last call has finished.

Opening a checkpoint leases every rank's folder first, then checks it and reads it from where
the lease holds it: training saves ``final`` again under the same name (the folder it replaces
is renamed, and kept while leased), so what is checked is what is served. A checkpoint deleted
before its lease is skipped for the next newest. ``refresh()`` checks the new checkpoint's files
that the one being served does not share (new SSTs, blob files, slot segments: every byte, by
CRC32) before it switches; a damaged one is refused (the follower logs it) and the served one
stays. A refresh never goes back in steps, except when the served checkpoint was deleted (a run
started over with ``--overwrite``): then the run's newest is served, whatever its step.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

import numpy as np

from ..checkpoint import ARRAYS, STATE, TRAINER_DIR, rank_folders
from ..data.features import FeatureTransform
from ..errors import ConfigError, InputError, SnapshotError
from ..nn import inference
from ..store.segments import SegmentInfo
from ..store.slot_snapshots import READ_FORMATS
from ..store.snapshots import (NewerFormatError, SnapshotDirectory, lease, read_manifest,
                               verify_files)
from .table import ServedTable

log = logging.getLogger("one_embedding.serve")

#: times a checkpoint is opened again when training renamed its folder while it was being read
#: (the lease keeps it; its new place, ``.old-<name>-<token>``, is never renamed again)
MAX_REOPENS = 3


class NotReadyError(SnapshotError):
    """A call to a ``Predictor`` that waits for its first checkpoint (``wait=True``) before
    training published one."""


class _Gone(Exception):
    """A checkpoint deleted (or replaced) between the listing and its lease."""


def _checkpoint_sets(path: str, name: str | None, newer: list | None = None) -> list[tuple]:
    """Every complete checkpoint under ``path``: (step, created, name, [folder per rank]) for
    each name that every rank of some world holds (with ``name`` given: only that name).
    ``newer``: collects the NewerFormatError of each snapshot a newer version wrote (left out,
    as damaged ones are, but worth saying when nothing else is there)."""
    found = []
    for world, ranks in rank_folders(path).items():
        if sorted(ranks) != list(range(world)):
            continue
        per_rank = []
        for r in range(world):
            snaps = SnapshotDirectory(ranks[r], create=False)
            have = {}
            for snap in snaps.names():
                if name is not None and snap != name:
                    continue
                try:
                    manifest = read_manifest(snaps.path(snap), snap)
                except NewerFormatError as e:
                    if newer is not None:
                        newer.append(e)
                    continue
                except SnapshotError:
                    continue
                step = (manifest.get("checkpoint") or {}).get("step")
                if isinstance(step, int):
                    have[snap] = (step, manifest.get("created_unix", 0.0))
            per_rank.append(have)
        for snap in set.intersection(*(set(h) for h in per_rank)) if per_rank else ():
            step = per_rank[0][snap][0]
            created = max(h[snap][1] for h in per_rank)
            found.append((step, created, snap, [SnapshotDirectory(ranks[r], create=False).path(snap)
                                                for r in range(world)]))
    return sorted(found)


@dataclasses.dataclass
class _Served:
    """One checkpoint being served: its table, model and transform, and who is using it."""

    name: str
    step: int
    created: float
    table: ServedTable
    model: object
    transform: FeatureTransform
    model_name: str
    #: the leases on its rank folders, let go when it is closed
    leases: list = dataclasses.field(default_factory=list)
    users: int = 0
    retired: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # users, retired

    def deleted(self) -> bool:
        """Whether training deleted this checkpoint (``--overwrite`` starts the run over,
        retention drops it): a lease then holds a ``.del-`` folder, and whatever the run holds
        now is what to serve, even at a lower step. A checkpoint saved again under its name
        (``.old-``) is not deleted: its newer self is served once it is listed."""
        return any(os.path.basename(held.folder_now()).startswith(".del-")
                   for held in self.leases)

    def close(self) -> None:
        self.table.close()
        for held in self.leases:
            held.release()
        self.leases = []


class Predictor:
    """persistent_path: a training run's ``--persistent-path``; snapshot: a checkpoint name to
    serve (None: the newest complete one); cache_mb: the RAM cache over the snapshot's rows;
    scratch: where private store folders go (default: the system's temporary folder); wait:
    where no complete checkpoint is there yet (or the folder itself is not), start without one
    instead of raising: ``ready`` is False and every call raises ``NotReadyError`` until a
    ``refresh()`` finds the first one (a server started beside its training)."""

    def __init__(self, persistent_path, snapshot: str | None = None, cache_mb: float = 64.0,
                 scratch: str | None = None, wait: bool = False):
        self.path = os.fspath(persistent_path)
        if not os.path.isdir(self.path) and not (wait and not os.path.exists(self.path)):
            what = "is a file" if os.path.exists(self.path) else "does not exist"
            raise ConfigError(f"persistent_path {self.path!r} {what}: pass the "
                              "--persistent-path folder of a training run")
        if not cache_mb >= 0:
            raise ConfigError(f"cache_mb={cache_mb!r} must be >= 0")
        self.requested, self.cache_mb, self.scratch = snapshot, float(cache_mb), scratch
        self._lock = threading.Lock()
        #: ((step, created, name), SnapshotError) of the newest checkpoint refused as damaged
        self._refused = None
        self._current: _Served | None = None
        if wait:
            try:
                self.refresh()
            except SnapshotError:   # a damaged first checkpoint: refused (``_refused``), and
                pass                # the next refresh says so; a newer one is still awaited
            return
        for _ in range(2):  # a second listing if every checkpoint listed was deleted meanwhile
            newer: list = []
            sets = _checkpoint_sets(self.path, snapshot, newer)
            if not sets and newer:
                raise NewerFormatError(f"{self.path!r} holds checkpoints only a newer "
                                       f"one_embedding reads: {newer[0]}")
            if not sets:
                others = sorted({c[2] for c in _checkpoint_sets(self.path, None)}) \
                    if snapshot else []
                if others:
                    raise SnapshotError(f"{self.path!r} holds no complete checkpoint named "
                                        f"{snapshot!r}; it holds {', '.join(map(repr, others))}: "
                                        "pick one, or leave --snapshot out for the newest")
                what = f"complete checkpoint named {snapshot!r}" if snapshot else \
                    "complete checkpoint"
                raise SnapshotError(f"{self.path!r} holds no {what} (every rank's part, with "
                                    "the training state): train with --persistent-path there first")
            for choice in reversed(sets):  # newest first
                try:
                    self._current = self._open(choice)
                    return
                except _Gone:
                    continue
        raise SnapshotError(f"{self.path!r}: every checkpoint listed was deleted before it could "
                            "be leased (twice): is retention keeping any?")

    # ---------------------------------------------------------------- which checkpoint
    def _newest(self):
        if not os.path.isdir(self.path):  # waiting for a run that has not started
            if os.path.exists(self.path):
                raise SnapshotError(f"persistent_path {self.path!r} is a file, not a training "
                                    "run's folder: no checkpoint can appear there")
            return None
        sets = _checkpoint_sets(self.path, self.requested)
        return sets[-1] if sets else None

    @property
    def ready(self) -> bool:
        """True once a checkpoint is served (always, unless made with ``wait=True``)."""
        return self._current is not None

    def check_ready(self) -> None:
        """NotReadyError unless a checkpoint is served."""
        self._served()

    def _waiting(self) -> NotReadyError:
        what = f"checkpoint named {self.requested!r}" if self.requested else "checkpoint"
        return NotReadyError(f"not ready: {self.path!r} holds no complete {what} yet; it is "
                             "served as soon as training publishes one")

    def _open(self, choice, served: "_Served | None" = None) -> _Served:
        """Lease every rank's folder of ``choice``, then check and open it from where the leases
        hold it. served: the checkpoint being served (a refresh): the new one's files it does
        not share are checked in full first. Raises _Gone when a lease cannot be taken (the
        checkpoint was deleted), SnapshotError when it is damaged."""
        step, created, name, folders = choice
        leases = []
        try:
            for f in folders:
                try:
                    leases.append(lease(f))
                except SnapshotError:
                    raise _Gone(f) from None
            for _ in range(MAX_REOPENS):
                where = [held.folder_now() for held in leases]
                try:
                    opened = self._open_leased(name, step, created, where, leases, served)
                except Exception as e:
                    if [held.folder_now() for held in leases] == where:
                        raise
                    # renamed while read: what failed was the snapshot saved under its name
                    log.warning("checkpoint %r was saved again while it was opened (%s); "
                                "reading the leased one from %s", name, e, leases[0].folder_now())
                    continue
                if [held.folder_now() for held in leases] == where:
                    return opened
                opened.table.close()  # renamed while read: read it again from its new place
            raise SnapshotError(f"checkpoint {name!r} under {self.path!r} was renamed "
                                f"{MAX_REOPENS} times while it was opened")
        except BaseException:
            for held in leases:
                held.release()
            raise

    def _open_leased(self, name, step, created, folders, leases, served) -> _Served:
        # checked as a load checks it (every file's size, the CRC32 of the files it does not
        # share; on a refresh also of the shared files new to this checkpoint): a damaged
        # snapshot is refused, never served
        known = _file_ids(served) if served is not None else set()
        manifests = []
        for f in folders:
            manifest = read_manifest(f, name)
            verify_files(f, name, manifest,
                         also=lambda fpath: served is not None and _file_id(fpath) not in known)
            manifests.append(manifest)
        with open(os.path.join(folders[0], TRAINER_DIR, STATE), "rb") as f:
            record = json.loads(f.read())
        with np.load(os.path.join(folders[0], TRAINER_DIR, ARRAYS), allow_pickle=False) as npz:
            arrays = {k[len("model/"):]: npz[k] for k in npz.files if k.startswith("model/")}
        cfg = _serving_config(record.get("config") or {})
        features = (record.get("state") or {}).get("features")
        transform = FeatureTransform.from_dict(features) if features else \
            FeatureTransform.for_config(cfg)
        model = _build_model(cfg, transform.num_sparse)
        model.load_state_dict({**(record.get("model") or {}), **arrays})
        model.eval()  # dropout off: a served score is a pure function of its row
        emb = model.embedding
        table = ServedTable(list(zip(folders, manifests)), emb.layout, emb.tables, emb.seed,
                            self.cache_mb, self.scratch, snapshot=name)
        emb.close()  # the skeleton's own (empty) store: the table above serves the rows
        try:
            if served is not None:
                _check_new_segments(table, known)
        except BaseException:
            table.close()
            raise
        return _Served(name, step, created, table, model, transform, cfg.model, leases=leases)

    def refresh(self) -> bool:
        """Switch to a newer complete checkpoint if training published one; True if it did.
        A newer one that fails its checks raises SnapshotError naming the file, and the one
        being served stays; asked again, the same checkpoint raises the same error without
        being read again (a damaged TB-sized one was re-read in full at every poll)."""
        choice = self._newest()
        cur = self._current
        if cur is None:   # waiting for the first checkpoint
            return choice is not None and self._first(choice)
        if choice is None or (choice[0], choice[1], choice[2]) == (cur.step, cur.created, cur.name):
            return False
        if (choice[0], choice[1]) < (cur.step, cur.created) and not cur.deleted():
            return False  # an older checkpoint (a resume from it): the served one stays
        if self._refused is not None and self._refused[0] == choice[:3]:
            raise self._refused[1]  # refused already: not read in full again every poll
        try:
            fresh = self._open(choice, served=cur)
        except _Gone:  # deleted meanwhile: the next look finds what replaced it
            return False
        except SnapshotError as e:
            self._refused = (choice[:3], e)
            raise
        with self._lock:
            old, self._current = self._current, fresh
        self._retire(old)
        return True

    def _first(self, choice) -> bool:
        """Open ``choice``, the first checkpoint of a predictor made with ``wait=True``: True
        when it is served now (False: deleted meanwhile). A damaged one raises SnapshotError
        as ``refresh`` does, once."""
        if self._refused is not None and self._refused[0] == choice[:3]:
            raise self._refused[1]
        try:
            fresh = self._open(choice)
        except _Gone:
            return False
        except SnapshotError as e:
            self._refused = (choice[:3], e)
            raise
        with self._lock:
            self._current = fresh
        return True

    def _acquire(self) -> _Served:
        with self._lock:
            served = self._current
            if served is None:
                raise self._waiting()
            with served.lock:
                served.users += 1
            return served

    def _release(self, served: _Served) -> None:
        with served.lock:
            served.users -= 1
            done = served.retired and served.users == 0
        if done:
            served.close()

    def _retire(self, served: _Served) -> None:
        with served.lock:
            served.retired = True
            done = served.users == 0
        if done:
            served.close()

    # ---------------------------------------------------------------- what it answers
    @property
    def snapshot(self) -> str:
        """The checkpoint answering calls now (NotReadyError before the first one)."""
        return self._served().name

    @property
    def model_name(self) -> str:
        return self._served().model_name

    @property
    def embedding_dim(self) -> int:
        return self._served().table.dim

    @property
    def num_sparse(self) -> int:
        return self._served().transform.num_sparse

    def _served(self) -> _Served:
        served = self._current
        if served is None:
            raise self._waiting()
        return served

    def lookup(self, keys, with_snapshot: bool = False):
        """keys (n,) int64 -> (n, embedding_dim) float32, the stored embedding columns (a key
        training never stored: its table's initializer value); with_snapshot: also the name of
        the checkpoint that answered."""
        keys = np.asarray(keys)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise InputError(f"keys have shape {keys.shape} and dtype {keys.dtype}; pass (n,) int64")
        served = self._acquire()
        try:
            rows = served.table.lookup(keys.astype(np.int64).view(np.uint64),
                                       np.zeros(keys.shape[0], np.int32))
            return (rows, served.name) if with_snapshot else rows
        finally:
            self._release(served)

    def predict(self, dense, categorical, with_snapshot: bool = False):
        """dense (n, 13) raw integer features (NaN = missing), categorical (n, 26) strings
        ("" = missing) -> (n,) float32 click probabilities, through the transform training used."""
        served = self._acquire()
        try:
            prob = _score(served, *_model_inputs(served, dense, categorical))
            return (prob, served.name) if with_snapshot else prob
        finally:
            self._release(served)

    def predict_many(self, requests) -> tuple[list, str]:
        """requests: [(dense (n_i, 13), categorical (n_i, 26))] -> ([(n_i,) float32
        probabilities, or the InputError refusing request i], the checkpoint that answered).
        One lookup and one forward over all the valid requests' rows together (the dynamic
        batcher's call); each request's scores are those ``predict`` gives it alone."""
        served = self._acquire()
        try:
            joint = _joint_inputs(served, requests)
            if joint is not None:  # every request valid: transformed together, one numpy pass
                prob = _score(served, *joint)
                ends = np.cumsum([np.shape(d)[0] for d, _ in requests])
                return list(np.split(prob, ends[:-1])), served.name
            results, valid = [None] * len(requests), []
            for i, (dense, categorical) in enumerate(requests):
                try:
                    valid.append((i, *_model_inputs(served, dense, categorical)))
                except InputError as e:
                    results[i] = e
            if valid:
                dense_in = np.concatenate([v[1] for v in valid])
                prob = _score(served, dense_in, np.concatenate([v[2] for v in valid]))
                ends = np.cumsum([v[1].shape[0] for v in valid])
                for (i, *_), part in zip(valid, np.split(prob, ends[:-1])):
                    results[i] = part
            return results, served.name
        finally:
            self._release(served)

    def close(self) -> None:
        with self._lock:
            served = self._current
        if served is not None:
            self._retire(served)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _model_inputs(served: _Served, dense, categorical) -> tuple[np.ndarray, np.ndarray]:
    """Raw features -> (dense (n, 13) float32, ids (n, f) int64) through the checkpoint's
    transform; InputError naming a value the model cannot take."""
    t = served.transform
    dense_in, ids = t.dense(dense), t.keys(categorical)
    if dense_in.shape[0] != ids.shape[0]:
        raise InputError(f"dense has {dense_in.shape[0]} rows but categorical "
                         f"{ids.shape[0]}: give one row of each per sample")
    return dense_in, ids


def _joint_inputs(served: _Served, requests):
    """The model inputs of all ``requests`` transformed together (the per-call costs paid once),
    or None when one of them is refused or they do not stack (then each is transformed alone,
    so that its refusal names its own rows)."""
    if len(requests) < 2 or not all(isinstance(c, np.ndarray) for _, c in requests):
        return None
    try:
        dense = [np.asarray(d) for d, _ in requests]
        cats = [np.asarray(c) for _, c in requests]
        if any(d.ndim != 2 or c.ndim != 2 or d.shape[0] != c.shape[0]
               for d, c in zip(dense, cats)):
            return None
        return _model_inputs(served, np.concatenate(dense), np.concatenate(cats))
    except (InputError, ValueError, TypeError):
        return None


def _score(served: _Served, dense_in: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(n, 13) float32 model inputs, (n, f) int64 ids -> (n,) float32 probabilities."""
    n, f = ids.shape
    tables = np.broadcast_to(np.arange(f, dtype=np.int32), (n, f)).reshape(-1) \
        if len(served.table.tables) > 1 else np.zeros(n * f, np.int32)
    rows = served.table.lookup(ids.reshape(-1).view(np.uint64), tables)
    with inference():  # keeps no activations: calls run their forwards side by side
        logits = served.model.forward_from_embeddings(dense_in, rows.reshape(n, f, served.table.dim))
    return (1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))).astype(np.float32)


def _file_id(path: str):
    """(device, inode) of a file: hard links of one file (an SST two snapshots link) are one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _file_ids(served: _Served) -> set:
    """Identities of every data file the served snapshot's ranks read: the files their
    manifests list and, for slot snapshots, the segments' rows files. Each rank's files are
    looked up where its lease holds them now: once training saved the snapshot again under its
    name, the name's folder holds the new snapshot, whose files are not the served ones."""
    ids = set()
    for rows, held in zip(served.table.ranks, served.leases):
        folder = held.folder_now()
        for rel in rows.manifest.get("files", {}):
            ids.add(_file_id(os.path.join(folder, *rel.split("/"))))
        for info in _segment_infos(rows, folder):
            ids.add(_file_id(rows.store.pool.path(info.id, "rows", rows.pool_folder())))
    ids.discard(None)
    return ids


def _segment_infos(rows, folder: str) -> list:
    """The segments a slots snapshot in ``folder`` lists (``slots.json``), else []. Each entry
    is read as its snapshot's format wrote it (format 2 names no block checksum: the legacy
    one), as the engine's own load reads it."""
    if rows.store is None or not hasattr(rows.store, "pool"):
        return []
    try:
        with open(os.path.join(folder, "slots.json"), "rb") as f:
            layout = json.loads(f.read())
    except (OSError, ValueError):
        return []
    fmt = layout.get("format") if isinstance(layout, dict) else None
    if not isinstance(fmt, int) or fmt not in READ_FORMATS:
        return []  # a format the engine refuses: its load says why
    return [SegmentInfo.from_dict(d, READ_FORMATS[fmt]) for d in layout.get("segments", [])]


def _check_new_segments(table: ServedTable, known: set) -> None:
    """Every row block of the slot segments new to this snapshot (rows files not in ``known``),
    checked against its CRC32 before the snapshot is served (SnapshotError naming the file)."""
    for rows in table.ranks:
        pool_dir, store = rows.pool_folder(), rows.store
        for info in _segment_infos(rows, rows.folder):
            if _file_id(store.pool.path(info.id, "rows", pool_dir)) not in known:
                store.pool.check(info, pool_dir, store.pool.block_bytes, full=True)


def _serving_config(saved: dict):
    """The run's ``TrainConfig`` for building its model: fields this version knows, the store
    replaced by an empty in-memory one (the served table holds the rows)."""
    from ..config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    fields = {k: v for k, v in saved.items() if k in known}
    fields.update(store="device_mem", persistent_path=None, resume=False, overwrite=False,
                  device="cpu", amp="off")
    # serving has no feature lifecycle; an older config's unused lifecycle options would be refused
    fields.update(admit_min_count=1, admit_sketch_mb=None, steps_to_live=0, max_rows=0,
                  evict_interval=0)
    for k in ("data", "bottom_mlp", "top_mlp", "dnn"):
        if isinstance(fields.get(k), list):
            fields[k] = tuple(fields[k])
    return TrainConfig(**fields)


def _build_model(cfg, num_tables: int):
    from ..config import make_row_optimizer
    from ..options import make_device_mem_store_options
    from ..training_setup import build_model

    size_factor = make_row_optimizer(cfg).required_size_factor()
    store = make_device_mem_store_options(None, capacity=1024, size_factor=size_factor)
    return build_model(cfg, num_tables, store)
