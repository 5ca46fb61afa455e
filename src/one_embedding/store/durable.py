"""Durable file primitives: fsync'd writes, atomic replace, directory sync."""
from __future__ import annotations

import errno
import os
import shutil

import numpy as np


def disk_full(e: BaseException) -> bool:
    """True for a full disk or an exhausted quota (ENOSPC, EDQUOT)."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def no_space_left(e: BaseException) -> bool:
    """True for a full disk as the RocksDB engine tells it: an OSError ENOSPC, or RocksDB's
    plain Exception (no errno) whose message says "No space left"."""
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)


def write_failed(doing: str, path: str, e: OSError, then: str) -> str:
    """The message of a write that failed with ``e``: ``doing`` what, on which ``path``, whether
    the disk is full (naming its folder), that the published snapshots are intact, and ``then``:
    what to do once space is free (the project's wording for every full disk)."""
    where = os.path.dirname(os.path.abspath(path))
    what = f"the disk of {where!r} is full" if disk_full(e) else "an I/O error stopped it"
    return (f"{doing} {path!r} failed: {what} ({e.strerror or e}). Every snapshot already "
            f"published is intact: free disk space, then {then}")


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def write_array(path: str, array: np.ndarray) -> None:
    """``array`` in ``.npy`` format (what ``np.load`` reads), then fsync, so the bytes are on
    disk when this returns. Written through the file object, not ``np.save`` (whose
    ``tofile`` reports a short write on a full disk as an OSError without an errno, which no
    caller could tell from another fault): a full disk is ENOSPC here."""
    from numpy.lib import format as npy

    array = np.require(array, requirements="C")  # (ascontiguousarray makes a 0-d array 1-d)
    with open(path, "wb") as f:
        npy.write_array_header_1_0(f, npy.header_data_from_array_1_0(array))
        if array.size:
            f.write(memoryview(array.reshape(-1)).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def read_array(path: str, mmap: bool = False) -> np.ndarray:
    return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write to a temp file, fsync, rename over ``path``, fsync the folder."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def file_crc32(path: str, chunk: int = 1 << 22) -> int:
    import zlib

    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def copy_file(src: str, dst: str) -> int:
    """Copy ``src`` to a new file ``dst`` (in the kernel with ``copy_file_range`` where it can),
    fsync it and return its size. The two files share no blocks afterwards (a file system that
    reflinks copies on write), so damaging one never damages the other, as a hard link would."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        size = os.fstat(fin.fileno()).st_size
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:  # src shrank under us
                    break
                done += n
        except OSError:  # no copy_file_range here (old kernel, another file system type)
            fin.seek(done)
            fout.seek(done)
            shutil.copyfileobj(fin, fout, 1 << 22)
        fout.flush()
        os.fsync(fout.fileno())
        return os.fstat(fout.fileno()).st_size
