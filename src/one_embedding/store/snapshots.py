"""Snapshots on disk: ``<persistent_path>/snapshots/<name>/`` with a manifest written last.

A snapshot is complete or absent, never half (DESIGN.md decision 6):

1. the bottom tier (and, for a training checkpoint, the trainer) writes its files into
   ``snapshots/.tmp-<name>-<token>/`` (each file fsync'd);
2. ``manifest.json`` (format version, dims, key dtype, line size, engine, row count, the size and
   CRC32 of every file below the folder, subfolders included, and a CRC32 of the manifest's own
   content) is written and fsync'd inside it, then the folder is fsync'd;
3. an older snapshot of the same name is renamed to ``.old-<name>-<token>``, the new folder is
   renamed to ``<name>`` and ``snapshots/`` is fsync'd; then the old one is reaped.

A snapshot need not hold its rows: the SSD engines keep them in immutable files the live table
and several snapshots share (slot segments in a pool, RocksDB SSTs hard-linked). A store may then
hand ``save`` the checksums of files it already knows (an SST linked into an earlier snapshot),
marked ``"shared"``: ``open`` checks their size, and their CRC32 only with ``verify="full"``, so
saving and loading cost what changed, not the table.

Deleting renames the folder to ``.del-<name>-<token>`` (one atomic step: gone or whole), then
*reaps* it: removes it, unless a reader in some process holds a *lease* on it. A lease
(``lease(folder)``) is a shared ``flock`` on the manifest; reaping takes it exclusively and
without waiting, so a snapshot a reader has open stays on disk, with whatever it refers to
(garbage collection of shared files counts ``.del-`` folders still there), until the reader lets
go; the next reap (any delete, save or open of the path) then removes it. A reader's process
that dies drops its lease with it.

``recover()`` runs when a path is opened: it deletes unfinished ``.tmp-*`` folders, reaps the
``.del-*`` ones, and, where a crash fell between the two renames of step 3, puts the ``.old-*``
snapshot back.

``open`` checks the manifest's own checksum, the fields the loader expects, and (``verify``) the
size and CRC32 of every file, so a damaged snapshot is refused when it is loaded, naming the
file, never half-way through training.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from typing import Callable

from ..errors import SnapshotError
from .durable import disk_full, file_crc32, fsync_dir, write_bytes_atomic

FORMAT_VERSION = 1


class NewerFormatError(SnapshotError):
    """A snapshot written by a newer one_embedding, in a format this version does not read: not
    damage (nothing is wrong with it), and never a reason to delete or overwrite it."""
MANIFEST = "manifest.json"
#: the manifest field holding the CRC32 of the rest of the manifest
MANIFEST_CRC = "manifest_crc32"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def _manifest_crc(fields: dict) -> int:
    """CRC32 of a manifest's content (every field but its own checksum), in a canonical form."""
    import zlib

    body = {k: v for k, v in fields.items() if k != MANIFEST_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def list_files(folder: str) -> list[str]:
    """Every file below ``folder``, as sorted '/'-separated relative paths."""
    out = []
    for root, _dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        for f in files:
            out.append(f if rel == "." else "/".join(rel.split(os.sep) + [f]))
    return sorted(out)


def read_manifest(folder: str, name: str) -> dict:
    """The manifest of the snapshot in ``folder``, checked for damage. Raises SnapshotError
    naming the file when it is unreadable, not JSON, of an unknown version or fails its own
    checksum."""
    mpath = os.path.join(folder, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise SnapshotError(f"snapshot {name!r}: {mpath} is damaged ({e}); load another "
                            "snapshot") from None
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise NewerFormatError(
            f"snapshot {name!r} ({folder}) was written by a newer one_embedding (format "
            f"{version}; this version reads {FORMAT_VERSION}): upgrade one_embedding to read it")
    if version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot {name!r}: {mpath} is damaged: format_version {version!r} "
                            f"is none one_embedding writes (this version reads "
                            f"{FORMAT_VERSION}); load another snapshot")
    # manifests written before the checksum existed have none: they are read as they are
    if MANIFEST_CRC in manifest and manifest[MANIFEST_CRC] != _manifest_crc(manifest):
        raise SnapshotError(f"snapshot {name!r}: {mpath} fails its own checksum (damaged); "
                            "load another snapshot")
    return manifest


def check_snapshot_name(name) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name.startswith("."):
        raise SnapshotError(
            f"snapshot name {name!r} is not allowed: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit"
        )
    return name


class SnapshotDirectory:
    """The ``snapshots/`` folder of one persistent path."""

    def __init__(self, persistent_path: str, create: bool = True):
        self.root = os.path.join(persistent_path, "snapshots")
        if create:
            os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def recover(self) -> None:
        entries = os.listdir(self.root)
        for entry in entries:
            if entry.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)
        for entry in entries:
            m = re.match(r"^\.old-(.+)-[0-9a-f]{32}$", entry)
            if not m:
                continue
            old = os.path.join(self.root, entry)
            final = self.path(m.group(1))
            if os.path.isfile(os.path.join(final, MANIFEST)):
                reap(old)
            else:
                os.rename(old, final)
        self.reap_deleted()
        fsync_dir(self.root)

    def reap_deleted(self) -> list[str]:
        """Remove every ``.del-*`` (and superseded ``.old-*``) folder no reader holds a lease
        on; returns those still held."""
        held = []
        for entry in sorted(os.listdir(self.root)):
            if entry.startswith(".del-") or (entry.startswith(".old-") and self._superseded(entry)):
                if not reap(os.path.join(self.root, entry)):
                    held.append(entry)
        return held

    def _superseded(self, entry: str) -> bool:
        m = re.match(r"^\.old-(.+)-[0-9a-f]{32}$", entry)
        return bool(m) and os.path.isfile(os.path.join(self.path(m.group(1)), MANIFEST))

    def delete(self, name: str) -> bool:
        """Remove snapshot ``name``: renamed out of sight first (one atomic step, so it is gone
        or whole), then reaped. Returns False when a reader's lease keeps its files for now
        (the name is gone either way; a later reap removes them). Raises SnapshotError naming
        the snapshots there are when ``name`` is not one of them."""
        check_snapshot_name(name)
        if name not in self.names():
            raise SnapshotError(f"no snapshot named {name!r} under {self.root!r} to delete; "
                                f"available: {self.names() or 'none'}")
        doomed = os.path.join(self.root, f".del-{name}-{uuid.uuid4().hex}")
        os.rename(self.path(name), doomed)
        fsync_dir(self.root)
        return reap(doomed)

    def folders(self) -> list[str]:
        """Every folder under ``snapshots/``: published, being written (``.tmp-``), replaced or
        deleted but still held (``.old-``, ``.del-``). Whatever they refer to is in use."""
        if not os.path.isdir(self.root):
            return []
        return [os.path.join(self.root, e) for e in sorted(os.listdir(self.root))
                if os.path.isdir(os.path.join(self.root, e))]

    def names(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(
            e for e in os.listdir(self.root)
            if not e.startswith(".") and os.path.isfile(os.path.join(self.root, e, MANIFEST))
        )

    def save(self, name: str, write_files: Callable[[str], dict | None], manifest: dict) -> dict:
        """Run ``write_files(tmp_dir)``, add the manifest, publish atomically. Returns the manifest.

        ``write_files`` may return ``{relative path: {"bytes", "crc32"}}`` for files whose
        checksum it already knows (shared, immutable files such as linked SSTs): they are
        recorded as given, marked ``"shared"``, and not read again."""
        check_snapshot_name(name)
        token = uuid.uuid4().hex
        tmp = os.path.join(self.root, f".tmp-{name}-{token}")
        try:
            os.mkdir(tmp)
            known = write_files(tmp) or {}
            files = {}
            for rel in list_files(tmp):
                fpath = os.path.join(tmp, *rel.split("/"))
                if rel in known:
                    files[rel] = {"bytes": int(known[rel]["bytes"]),
                                  "crc32": int(known[rel]["crc32"]), "shared": True}
                else:
                    files[rel] = {"bytes": os.path.getsize(fpath), "crc32": file_crc32(fpath)}
            full = {
                "format_version": FORMAT_VERSION,
                "name": name,
                "created_unix": time.time(),
                **manifest,
                "files": files,
            }
            full[MANIFEST_CRC] = _manifest_crc(full)
            write_bytes_atomic(os.path.join(tmp, MANIFEST), json.dumps(full, indent=1).encode())
            fsync_dir(tmp)
            final = self.path(name)
            old = None
            if os.path.exists(final):
                old = os.path.join(self.root, f".old-{name}-{token}")
                os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except OSError as e:
            # a full or failing disk: the previous snapshot of this name is still in place
            shutil.rmtree(tmp, ignore_errors=True)
            what = f"the disk of {self.root!r} is full" if disk_full(e) else \
                "an I/O error stopped it"
            kept = "the previous snapshot of that name is intact" \
                if os.path.exists(self.path(name)) else \
                "every snapshot already published is intact (none had that name)"
            raise SnapshotError(
                f"saving snapshot {name!r} under {self.root!r} failed: {what} "
                f"({e.strerror or e}); {kept}: free disk space and save again") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            reap(old)
        return full

    def open(self, name: str, expected: dict, verify: bool | str = True) -> tuple[str, dict]:
        """The folder and manifest of snapshot ``name``, checked against ``expected`` fields.

        verify: False (the manifest only), True (every file's size; the CRC32 of each file the
        snapshot does not share), "full" (every file's CRC32)."""
        check_snapshot_name(name)
        folder = self.path(name)
        mpath = os.path.join(folder, MANIFEST)
        if not os.path.isfile(mpath):
            have = self.names()
            raise SnapshotError(
                f"no snapshot named {name!r} under {self.root!r}; available: {have or 'none'}"
            )
        manifest = read_manifest(folder, name)
        for key, want in expected.items():
            got = manifest.get(key)
            if got != want:
                raise SnapshotError(
                    f"snapshot {name!r} was saved with {key}={got!r} but this embedding has "
                    f"{key}={want!r}: open it with the same {key}, or save a new snapshot"
                )
        if verify:
            verify_files(folder, name, manifest, full=verify == "full")
        return folder, manifest


def verify_files(folder: str, name: str, manifest: dict, full: bool = False,
                 also=lambda fpath: False) -> None:
    """Check the files ``manifest`` lists in ``folder`` (snapshot ``name``): every file's size,
    and the CRC32 of each file the snapshot does not share (``full``: of every file; ``also``:
    of the shared files for which it returns True). Raises SnapshotError naming the file."""
    for fname, info in manifest["files"].items():
        fpath = os.path.join(folder, *fname.split("/"))
        if not os.path.isfile(fpath) or os.path.getsize(fpath) != info["bytes"]:
            raise SnapshotError(f"snapshot {name!r}: file {fpath!r} is missing or truncated")
        if (full or not info.get("shared") or also(fpath)) and file_crc32(fpath) != info["crc32"]:
            raise SnapshotError(f"snapshot {name!r}: file {fpath!r} fails its checksum")


# ---------------------------------------------------------------- leases


class Lease:
    """A reader's shared hold on one snapshot folder (see the module docstring); release() or
    leave the ``with`` block to let go."""

    def __init__(self, folder: str, fd: int):
        self.folder, self._fd = folder, fd

    def folder_now(self) -> str:
        """Where the leased folder is now: a snapshot saved again under its name renames the
        folder this lease holds (to ``.old-<name>-<token>``, kept while leased), so its files
        are read from here, never from the name, which may hold another snapshot by then."""
        if self._fd is None:
            raise SnapshotError(f"the lease on {self.folder!r} was released")
        return os.path.dirname(os.readlink(f"/proc/self/fd/{self._fd}"))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def lease(folder: str) -> Lease:
    """A shared lease on the snapshot in ``folder``: while held, deleting the snapshot keeps its
    files (and what they refer to) on disk. Raises SnapshotError when the snapshot is gone or
    being deleted."""
    mpath = os.path.join(folder, MANIFEST)
    try:
        fd = os.open(mpath, os.O_RDONLY)
    except OSError:
        raise SnapshotError(f"snapshot {folder!r} has no manifest: it was deleted or never "
                            "finished") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        # the folder may have been renamed away (deleted) between the open and the lock
        if os.stat(mpath).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(mpath)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) or isinstance(e, FileNotFoundError):
            raise SnapshotError(f"snapshot {folder!r} is being deleted") from None
        raise
    return Lease(folder, fd)


def reap(folder: str) -> bool:
    """Remove a deleted (or replaced) snapshot folder unless a reader holds a lease on it.
    Returns True when it is gone."""
    mpath = os.path.join(folder, MANIFEST)
    try:
        fd = os.open(mpath, os.O_RDONLY)
    except OSError:  # no manifest (never published, or half removed): nobody can lease it
        shutil.rmtree(folder, ignore_errors=True)
        return not os.path.exists(folder)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        # the manifest goes first: a crash mid-removal leaves a folder no reader can lease
        os.unlink(mpath)
        shutil.rmtree(folder, ignore_errors=True)
        return not os.path.exists(folder)
    finally:
        os.close(fd)
