"""Training checkpoints: an embedding snapshot plus everything else a run needs to continue.

::

    save_checkpoint("step-100", emb, model=model, optimizer=opt, lr_schedule=sched,
                    state={"step": 100, "epoch": 0, "batch": 100, ...}, config={...})
    state = load_checkpoint("step-100", emb, model=model, optimizer=opt, lr_schedule=sched)

A checkpoint is one snapshot (``<persistent_path>/<rank>-<world>/snapshots/<name>/``): the
embedding's rows (with their optimizer state) and, in ``trainer/``, ``arrays.npz`` (the model's
parameters and the dense optimizer's state, no pickle) and ``state.json`` (step counts, the LR
schedule's position, dropout counters, the caller's ``state`` such as the data position and the
metric accumulators, and the run's ``config``). The trainer files are written into the snapshot's
temporary folder before its manifest, so they are published atomically with the rows, covered
by the manifest's checksums, and verified when loaded. The manifest's ``"checkpoint"`` field names
the step, which is how ``checkpoints`` finds the newest one.

With several ranks every rank writes its own rows and the same trainer state (dense weights are
replicated), so any rank's folder can restore it.
"""
from __future__ import annotations

import io
import json
import logging
import os

import numpy as np

from .errors import LockedError, SnapshotError
from .store.durable import fsync_path
from .store.lock import PathLock
from .store.snapshots import (MANIFEST, NewerFormatError, SnapshotDirectory, read_manifest,
                              verify_files)

log = logging.getLogger("one_embedding.checkpoint")

TRAINER_DIR = "trainer"
ARRAYS = "arrays.npz"
STATE = "state.json"


def _split(state_dict: dict, prefix: str) -> tuple[dict, dict]:
    """(arrays, scalars) of a state_dict, keys prefixed."""
    arrays, scalars = {}, {}
    for key, value in state_dict.items():
        if isinstance(value, np.ndarray):
            arrays[f"{prefix}/{key}"] = value
        else:
            scalars[key] = value
    return arrays, scalars


def save_checkpoint(name: str, embedding, *, model=None, optimizer=None, lr_schedule=None,
                    state: dict | None = None, config: dict | None = None,
                    state_arrays: dict | None = None) -> None:
    """Save snapshot ``name`` of ``embedding`` with the training state beside its rows.

    model / optimizer / lr_schedule: objects with ``state_dict()`` (``nn.Module``,
    ``one_embedding.Optimizer``, an ``optim.lr_schedules`` schedule), each optional; state: JSON
    values of the caller's own (``state["step"]`` names the checkpoint's step); state_arrays:
    numpy arrays of the caller's own, kept binary beside the model's (a run's per-step losses:
    in JSON they made every checkpoint grow with the run); config: the run's configuration,
    kept for comparison on resume. Durable and complete when it returns.
    """
    arrays, scalars = {f"state/{k}": np.asarray(v) for k, v in (state_arrays or {}).items()}, {}
    for key, obj in (("model", model), ("optimizer", optimizer), ("lr_schedule", lr_schedule)):
        if obj is not None:
            a, s = _split(obj.state_dict(), key)
            arrays.update(a)
            scalars[key] = s
    record = {**scalars, "state": state or {}, "config": config}
    payload = json.dumps(record, default=_json_default).encode()  # fail before writing anything

    def write(folder: str) -> None:
        sub = os.path.join(folder, TRAINER_DIR)
        os.mkdir(sub)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        for fname, data in ((ARRAYS, buffer.getvalue()), (STATE, payload)):
            path = os.path.join(sub, fname)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_path(sub)

    step = (state or {}).get("step")
    embedding.save_snapshot(name, extra_files=write,
                            extra_fields={"checkpoint": {"step": step, "files": [ARRAYS, STATE]}})


def load_checkpoint(name: str, embedding, *, model=None, optimizer=None, lr_schedule=None,
                    world: int | None = None) -> dict:
    """Load checkpoint ``name``: the embedding's rows, and the state of whichever of model /
    optimizer / lr_schedule is given; ``world``: of the set saved by that many ranks (default:
    this world's, else the newest other set holding it). Returns ``{"state": ..., "config":
    ..., "state_arrays": ...}`` as saved."""
    manifest = embedding.load_snapshot(name) if world is None else \
        embedding.load_snapshot(name, saved_by=world)
    if "checkpoint" not in manifest:
        raise SnapshotError(f"snapshot {name!r} holds embedding rows only, no training state: "
                            "it was saved by save_snapshot, not save_checkpoint")
    sub = os.path.join(manifest["folder"], TRAINER_DIR)
    try:
        with open(os.path.join(sub, STATE), "rb") as f:
            record = json.loads(f.read())
        with np.load(os.path.join(sub, ARRAYS), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as e:
        raise SnapshotError(f"checkpoint {name!r}: the training state in {sub!r} is unreadable "
                            f"({e}); load another checkpoint") from None
    for key, obj in (("model", model), ("optimizer", optimizer), ("lr_schedule", lr_schedule)):
        if obj is None:
            continue
        if key not in record:
            raise SnapshotError(f"checkpoint {name!r} holds no {key} state")
        prefix = f"{key}/"
        obj.load_state_dict({**record[key], **{k[len(prefix):]: v for k, v in arrays.items()
                                               if k.startswith(prefix)}})
    return {"state": record.get("state", {}), "config": record.get("config"),
            "state_arrays": {k[len("state/"):]: v for k, v in arrays.items()
                             if k.startswith("state/")}}


def checkpoints(rank_folder: str, damaged: list | None = None) -> list[tuple[int, str]]:
    """The (step, name) of every complete checkpoint in a rank folder ``<path>/<r>-<P>``,
    oldest first. Snapshots without training state, or with a damaged manifest, are left out
    (the latter's SnapshotErrors appended to ``damaged`` when given). One written by a newer
    one_embedding raises its NewerFormatError: a resume must neither go back past it nor call
    the folder empty (its advice, --overwrite, would delete it), and pruning must not delete it."""
    snaps = SnapshotDirectory(rank_folder, create=False)
    found = []
    for name in snaps.names():
        try:
            manifest = read_manifest(snaps.path(name), name)
        except NewerFormatError:
            raise
        except SnapshotError as e:
            if damaged is not None:
                damaged.append(e)
            continue
        step = (manifest.get("checkpoint") or {}).get("step")
        if isinstance(step, int):
            found.append((step, name))
    return sorted(found)


def _json_default(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, (tuple, set)):
        return list(value)
    raise SnapshotError(f"checkpoint state holds {value!r} ({type(value).__name__}), which JSON "
                        "cannot store: keep state to numbers, strings and lists")


# ---------------------------------------------------------------- runs on a persistent path


def rank_folders(path: str) -> dict[int, dict[int, str]]:
    """{world: {rank: folder}} of the ``<path>/<rank>-<world>`` folders under ``path``."""
    import re

    out: dict[int, dict[int, str]] = {}
    if not path or not os.path.isdir(path):
        return out
    for entry in os.listdir(path):
        m = re.fullmatch(r"(\d+)-(\d+)", entry)
        if m and os.path.isdir(os.path.join(path, entry)):
            out.setdefault(int(m.group(2)), {})[int(m.group(1))] = os.path.join(path, entry)
    return out


def why_no_checkpoint(path: str) -> str:
    """What keeps ``path``'s snapshots from a complete checkpoint, per set of rank folders (a
    rank's folder missing, no step every rank holds, snapshots without training state), and
    what to do; for --resume's refusal (it said "snapshots without training state" where a
    rank's folder was missing)."""
    sets = rank_folders(path)
    said = []
    for world, ranks in sorted(sets.items()):
        missing = [f"{r}-{world}" for r in range(world) if r not in ranks]
        if missing:
            said.append(f"the set of {world} rank(s) lacks the folder(s) {', '.join(missing)}")
            continue
        steps = [set(s for s, _ in checkpoints(ranks[r])) for r in range(world)]
        if not any(steps):
            said.append(f"the {world} rank folder(s) hold(s) no checkpoint (snapshots without "
                        "training state only)")
        else:
            said.append(f"no step is held by all {world} rank folders (steps per rank: "
                        + "; ".join(f"{r}-{world}: {sorted(s)[-3:] or 'none'}"
                                    for r, s in enumerate(steps)) + ")")
    if not said:
        return ("it holds no rank folder (<rank>-<world>): train without --resume, with "
                "--snapshot-interval N to write checkpoints")
    return "; ".join(said) + (": restore the missing rank folders, or train without --resume "
                              "(--overwrite starts the run over)")


def snapshots_under(path: str) -> list[str]:
    """``<rank>-<world>/<name>`` of every published snapshot under a persistent path."""
    found = []
    for world, ranks in sorted(rank_folders(path).items()):
        for rank, folder in sorted(ranks.items()):
            found += [f"{os.path.basename(folder)}/{n}"
                      for n in SnapshotDirectory(folder, create=False).names()]
    return found


def newest_checkpoint(path: str, rank: int, world: int, comm) -> tuple[str, int] | None:
    """(name, world it was saved by) of the newest checkpoint every rank can resume from: the
    newest step among this world's checkpoints that all its rank folders hold and every
    complete set saved by another number of ranks (re-sharded on load), this world's first at
    an equal step. None when there is none. (It took this world's whenever it had one: a run
    resumed on 1 rank after steps 31-60 ran on 2 went back to step 30.)"""
    folders = rank_folders(path)
    damaged: list = []
    mine = checkpoints(folders[world][rank], damaged) if rank in folders.get(world, {}) else []
    for e in damaged:  # its step is unknown: it may have been the newest
        log.warning("resume: a snapshot is left out, its manifest is damaged (%s); "
                    "`one-embedding inspect %s` lists every snapshot", e, path)
    width = 256
    steps = np.full(width, -1, np.int64)
    steps[: min(width, len(mine))] = [s for s, _ in mine][-width:]
    every = comm.allgather(steps[None, :])  # (world, width): each rank's steps
    common = set(every[0][every[0] >= 0].tolist())
    for row in every[1:]:
        common &= set(row[row >= 0].tolist())
    found = []  # (step, this world's, name, world)
    if common:
        best = max(common)
        found.append((best, 1, max(n for s, n in mine if s == best), world))
    for other, (step, name) in _other_worlds_newest(folders, world).items():
        found.append((step, 0, name, other))
    if not found:
        return None
    _, _, name, saved_by = max(found)
    return name, saved_by


def final_of_any_world(path: str, name: str, step: int) -> bool:
    """Whether every rank folder of some complete set under ``path`` holds checkpoint ``name``
    at ``step`` (a run finished there, by whatever number of ranks)."""
    for world, ranks in rank_folders(path).items():
        if sorted(ranks) == list(range(world)) and all(
                dict((n, s) for s, n in checkpoints(ranks[r])).get(name) == step
                for r in range(world)):
            return True
    return False


def _other_worlds_newest(folders: dict, world: int) -> dict:
    """{P: (step, name)} of the newest checkpoint every rank folder of each complete set saved
    by P != ``world`` ranks holds."""
    out = {}
    for other, ranks in folders.items():
        if other == world or sorted(ranks) != list(range(other)):
            continue
        per_rank = [dict((s, n) for s, n in checkpoints(ranks[r])) for r in range(other)]
        shared = set(per_rank[0]).intersection(*per_rank[1:])
        if shared:
            out[other] = (max(shared), per_rank[0][max(shared)])
    return out


def resumable_checkpoint(path: str, world: int) -> tuple[int, str] | None:
    """(step, name) of the checkpoint ``--resume`` would continue from, read from the disk
    alone (no collective: for a run that is being interrupted): the newest step among those
    every rank folder of ``world`` visible here holds and the complete sets saved by another
    number of ranks, this world's first at an equal step. None when there is none."""
    folders = rank_folders(path)
    found = [(step, 0, name) for step, name in _other_worlds_newest(folders, world).values()]
    ranks = folders.get(world, {})
    if ranks:
        per_rank = [dict(checkpoints(folder)) for folder in ranks.values()]
        shared = set(per_rank[0]).intersection(*per_rank[1:])
        if shared:
            found.append((max(shared), 1, per_rank[0][max(shared)]))
    if not found:
        return None
    step, _, name = max(found)
    return step, name


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during ``Trainer.run``: where the run stood and what continues it.

    step: the steps finished when it was interrupted (None: before the run began);
    persistent_path: the run's folder (None: nothing was saved); checkpoint: (step, name) of the
    newest checkpoint ``resume=True`` (``--resume``) continues from, None when none is saved yet.
    A KeyboardInterrupt, so code that stops on Ctrl-C still stops."""

    def __init__(self, step: int | None, persistent_path: str | None,
                 checkpoint: tuple[int, str] | None):
        self.step, self.persistent_path, self.checkpoint = step, persistent_path, checkpoint
        super().__init__(self.describe())

    def describe(self, how_to_resume: bool = True) -> str:
        """One sentence: the step, the last checkpoint, and (``how_to_resume``) that
        ``resume=True`` continues from it."""
        at = "interrupted before training began" if self.step is None else \
            f"interrupted at step {self.step}"
        if not self.persistent_path:
            return (f"{at}; nothing was saved (no persistent_path): --persistent-path DIR with "
                    "--snapshot-interval N writes checkpoints that --resume continues from")
        if self.checkpoint is None:
            return (f"{at}; no checkpoint was saved under {self.persistent_path!r} yet, so there "
                    "is nothing to resume: start the run again")
        step, name = self.checkpoint
        saved = (f"{at}; the last checkpoint saved is {name!r} (step {step}) under "
                 f"{self.persistent_path!r}")
        return f"{saved}: resume=True (--resume) continues from it" if how_to_resume else saved


def saved_config(path: str, name: str, world: int | None = None) -> dict | None:
    """The run config stored with checkpoint ``name`` (read from the first rank folder holding
    it; of the set saved by ``world`` ranks when given), checked against its manifest first:
    SnapshotError naming the file when it is damaged (read unchecked, a damaged file passed for
    a config of defaults, and --resume called the checkpoint another run's). None when no rank
    folder holds ``name``."""
    for saved_by, ranks in rank_folders(path).items():
        if world is not None and saved_by != world:
            continue
        for folder in ranks.values():
            snap = SnapshotDirectory(folder, create=False).path(name)
            if not os.path.isfile(os.path.join(snap, MANIFEST)):
                continue
            manifest = read_manifest(snap, name)
            rel = f"{TRAINER_DIR}/{STATE}"
            info = manifest.get("files", {}).get(rel)
            if info is None:
                raise SnapshotError(f"checkpoint {name!r} under {folder!r} holds no {rel}: it "
                                    "is not a training checkpoint")
            try:  # this file alone (the others are checked when the checkpoint is loaded)
                verify_files(snap, name, {"files": {rel: info}}, full=True)
            except SnapshotError as e:
                raise SnapshotError(
                    f"checkpoint {name!r} is damaged: {e} (`one-embedding inspect {path}` lists "
                    f"every snapshot); to resume from the checkpoint before it, move {snap!r} "
                    "(in every rank folder) out of the way") from None
            with open(os.path.join(snap, TRAINER_DIR, STATE), "rb") as f:
                return json.loads(f.read()).get("config")
    return None


def config_differences(saved: dict, current: dict, free: set) -> list[str]:
    """``field: saved -> current`` for every field that differs, except those in ``free``
    (fields that do not change results, such as the number of steps)."""
    norm = lambda v: json.loads(json.dumps(v, default=_json_default))  # noqa: E731
    out = []
    for key in sorted(set(saved) | set(current)):
        if key in free:
            continue
        a, b = norm(saved.get(key)), norm(current.get(key))
        if a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def prune_checkpoints(embedding, keep: int, prefix: str = "step-") -> list[str]:
    """Delete all but the ``keep`` newest checkpoints whose name starts with ``prefix`` (others,
    such as the final one, are kept) through ``embedding.delete_snapshot``, which reclaims the
    disk only they used. Every rank calls it. Returns the names deleted."""
    interval = [(s, n) for s, n in checkpoints(embedding._owner().path) if n.startswith(prefix)]
    doomed = [n for _, n in interval[:-keep]] if keep > 0 else []
    for name in doomed:
        embedding.delete_snapshot(name)
    return doomed


def check_set_idle(path: str, world: int, comm) -> None:
    """LockedError on every rank when a process holds one of the rank folders of the set saved
    by ``world`` ranks under ``path`` (a live run of another number of ranks): a resume is about
    to read them, and they may change under it (a resume raced such a run's pruning and called
    the checkpoint damaged). Rank 0 probes each folder's lock and lets it go at once."""
    said = ""
    if comm.rank == 0:
        for folder in rank_folders(path).get(world, {}).values():
            try:
                PathLock(folder).release()
            except LockedError as e:
                said = f"--resume: the checkpoint to resume from was saved by {world} ranks, " \
                       f"and {e}"
                break
    if comm.allreduce_sum(np.array([float(bool(said))]))[0]:
        raise LockedError(said or f"--resume: the rank folders of the {world}-rank set under "
                                  f"{path!r} are in use by another process (rank 0 names it)")


def remove_snapshots(path: str) -> None:
    """Delete every snapshot under a persistent path (``--overwrite``).

    Every rank folder's LOCK is taken first, all of them before anything is deleted: a folder
    that another live process holds (a run still training there) raises ``LockedError`` naming
    its pid, with nothing deleted anywhere. The locks are released on return, so the embedding
    built next can take its own."""
    folders = [folder for ranks in rank_folders(path).values() for folder in ranks.values()]
    locks = []
    try:
        for folder in folders:
            try:
                locks.append(PathLock(folder))
            except LockedError as e:
                raise LockedError(f"--overwrite deleted nothing: {e}") from None
        for folder in folders:
            snaps = SnapshotDirectory(folder, create=False)
            for name in snaps.names():
                snaps.delete(name)
    finally:
        for lock in locks:
            lock.release()
