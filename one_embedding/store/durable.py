"""Durable file primitives: fsync'd writes, atomic replace, directory sync."""
from __future__ import annotations

import os

import numpy as np


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def write_array(path: str, array: np.ndarray) -> None:
    """``np.save`` then fsync, so the bytes are on disk when this returns."""
    with open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
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
