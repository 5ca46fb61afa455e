"""Block-aligned file I/O: O_DIRECT where the filesystem allows it, buffered where it does not.

The slot engine reads and writes whole blocks of ``block_bytes`` (a multiple of the device's
``physical_block_size``) at block-aligned offsets of its segment files, from page-aligned
buffers, so the same calls work with ``O_DIRECT``: the kernel moves the bytes between the disk
and our buffer and the page cache holds none of them. RAM use is then what the process allocates (its caches, this module's
buffer), and a benchmark of the engine measures the disk rather than memory.

One random 4 KiB read at a time gets about a fifth of the disk's rate: ``python -m
benchmarks.bench_ssd`` measured 14.6k O_DIRECT reads/s with one thread and 72.0k/s with 16 in
flight (``benchmarks/results/bench_ssd.json``), so ``IOPool`` reads and writes a batch of blocks
with a pool of threads; runs of adjacent blocks are merged into one call. Each thread issues its
share of the calls from a numba kernel that calls libc ``pread`` / ``pwrite`` with the GIL released
for the whole share, not one ``os.preadv`` per block: each ``os.preadv`` thread must win the GIL
back after every read, so it competes with every other thread running Python code (no committed
benchmark compares the two).

A filesystem without O_DIRECT (tmpfs before Linux 6.6) refuses ``open`` with EINVAL; a block
size below the device's logical block refuses the first read. Either way the file is reopened without
O_DIRECT after one warning: the code path stays the same, the bytes go through the page cache.
"""
from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, types

#: paths already warned about (one warning per path and process, whatever the warning filters)
_WARNED: set[str] = set()
#: longest run of adjacent blocks one call moves: long enough to merge neighbours, short enough
#: that one thread's run does not keep the others waiting
MAX_RUN_BYTES = 1 << 20
#: shares of a transfer per I/O thread (see ``IOPool._transfer``)
SHARES_PER_THREAD = 4

# os.open, named so a test can make O_DIRECT fail as tmpfs does
_open = os.open

# libc's pread / pwrite, resolved by name when a kernel is linked (so the kernels cache); the
# buffer address is passed as an integer, as the x86-64 and aarch64 calling conventions allow
_pread = types.ExternalFunction("pread", types.intp(types.int32, types.intp, types.intp, types.int64))
_pwrite = types.ExternalFunction("pwrite", types.intp(types.int32, types.intp, types.intp, types.int64))


@njit(cache=True, nogil=True)
def _pread_runs(fds, base, file_offsets, buf_offsets, lengths):
    """Read run j (``lengths[j]`` bytes at ``file_offsets[j]`` of file ``fds[j]``) into address
    ``base + buf_offsets[j]``, for every j; a short read resumes. Returns -1, or the first run
    that failed (the caller repeats it with ``os.preadv`` to raise the error with its errno)."""
    for j in range(file_offsets.shape[0]):
        done = 0
        while done < lengths[j]:
            got = _pread(fds[j], base + buf_offsets[j] + done, lengths[j] - done,
                         file_offsets[j] + done)
            if got <= 0:
                return j
            done += got
    return -1


@njit(cache=True, nogil=True)
def _pwrite_runs(fds, base, file_offsets, buf_offsets, lengths):
    """``_pread_runs`` for writes."""
    for j in range(file_offsets.shape[0]):
        done = 0
        while done < lengths[j]:
            got = _pwrite(fds[j], base + buf_offsets[j] + done, lengths[j] - done,
                          file_offsets[j] + done)
            if got <= 0:
                return j
            done += got
    return -1


def open_block_file(path: str, flags: int, direct: bool,
                    warn_as: str | None = None) -> tuple[int, bool]:
    """``os.open(path, flags [| O_DIRECT], 0o644)`` -> (fd, whether O_DIRECT is on).

    With ``direct`` a filesystem that refuses O_DIRECT (EINVAL, as tmpfs does) gets the file
    opened without it, after a one-line warning naming ``warn_as`` (default: the path; once per
    name).
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return _open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            warn_buffered(warn_as or path, "the filesystem refuses O_DIRECT")
    return _open(path, flags, 0o644), False


def probe_direct_io(folder: str) -> bool:
    """Whether the file system of ``folder`` accepts O_DIRECT opens."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(folder, f".direct-io-probe-{os.getpid()}")
    try:
        fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    os.close(fd)
    return True


def warn_buffered(path: str, why: str) -> None:
    """The one-line warning of the buffered fallback, once per path."""
    if path in _WARNED:
        return
    _WARNED.add(path)
    warnings.warn(f"{path}: {why}; its blocks are read and written through the page cache, so "
                  "its RAM use is not bounded by the cache budgets", RuntimeWarning, stacklevel=3)


class AlignedBuffer:
    """A page-aligned anonymous mapping that O_DIRECT transfers may target; grows on demand, and
    is never smaller than ``min_bytes`` once used (so its size, and the RAM a store reports, does
    not depend on the last batch; untouched pages of the mapping take no RAM)."""

    def __init__(self, min_bytes: int = 0):
        self._mm: mmap.mmap | None = None
        self.min_bytes = int(min_bytes)

    @property
    def nbytes(self) -> int:
        return 0 if self._mm is None else len(self._mm)

    def get(self, nbytes: int) -> mmap.mmap:
        """The buffer, at least ``nbytes`` long (its contents are kept only while it does not grow)."""
        if self._mm is None or len(self._mm) < nbytes:
            size = -(-max(int(nbytes), self.min_bytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
            self.release()
            self._mm = mmap.mmap(-1, size)
        return self._mm

    def release(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
            self._mm = None


def block_runs(blocks: np.ndarray, positions: np.ndarray, max_run: int,
               files: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """blocks: (k,) int64, ascending within each file; positions: (k,) int64 ascending, their
    places in the buffer; files: (k,) the file of each block (default: one file) -> (starts,
    stops) (r,) int64: index ranges adjacent on disk, in the buffer and in one file (so one call
    moves each), at most ``max_run`` blocks each."""
    k = blocks.shape[0]
    if k == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    new_run = np.ones(k, np.bool_)
    new_run[1:] = (np.diff(blocks) != 1) | (np.diff(positions) != 1)
    if files is not None:
        new_run[1:] |= files[1:] != files[:-1]
    run_first = np.flatnonzero(new_run)
    position = np.arange(k) - run_first[np.cumsum(new_run) - 1]  # index within its run
    starts = np.flatnonzero(new_run | (position % max_run == 0))
    return starts, np.append(starts[1:], k).astype(np.int64)


class IOPool:
    """Reads and writes batches of blocks with ``io_threads`` requests in flight.

    A transfer names, per block, its file (an fd), its index in that file and its place in a
    page-aligned buffer; runs of blocks adjacent on disk and in the buffer move in one call.
    """

    def __init__(self, io_threads: int = 16):
        self._pool = None
        self.set_io_threads(io_threads)

    def set_io_threads(self, io_threads: int) -> None:
        """Requests in flight from now on (1: every call on the calling thread)."""
        self.io_threads = max(1, int(io_threads))
        if self._pool is not None:
            self._pool.shutdown()
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="one_embedding-io") \
            if self.io_threads > 1 else None

    def read(self, fds: np.ndarray, blocks: np.ndarray, block_bytes: int, buffer: mmap.mmap,
             positions: np.ndarray | None = None) -> None:
        """fds: (k,) int32 the file of each block; blocks: (k,) int64 block indices, unique and
        ascending within each file; block ``blocks[i]`` of file ``fds[i]`` -> ``buffer`` at byte
        ``positions[i] * block_bytes`` (positions: (k,) int64 ascending, default ``0..k-1``)."""
        self._transfer(_pread_runs, os.preadv, fds, blocks, block_bytes, buffer, positions)

    def write(self, fd: int, blocks: np.ndarray, block_bytes: int, buffer: mmap.mmap,
              positions: np.ndarray | None = None) -> None:
        """blocks: (k,) int64 ascending, unique: ``buffer`` at byte ``positions[i] *
        block_bytes`` -> block ``blocks[i]`` of file ``fd``."""
        fds = np.full(blocks.shape[0], fd, np.int32)
        self._transfer(_pwrite_runs, os.pwritev, fds, blocks, block_bytes, buffer, positions)

    def _transfer(self, kernel, op, fds, blocks, block_bytes, buffer, positions) -> None:
        if positions is None:
            positions = np.arange(blocks.shape[0], dtype=np.int64)
        fds = np.ascontiguousarray(fds, np.int32)
        starts, stops = block_runs(blocks, positions, max(1, MAX_RUN_BYTES // block_bytes), fds)
        n_runs = starts.shape[0]
        if n_runs == 0:
            return
        run_fds = fds[starts]
        file_offsets = blocks[starts] * block_bytes
        buf_offsets = positions[starts] * block_bytes
        lengths = (stops - starts) * block_bytes
        n_shares = 1 if self._pool is None else min(self.io_threads * SHARES_PER_THREAD, n_runs)
        # runs are dealt round-robin (sorted by offset, so each share sweeps the file once) into
        # more shares than threads: a thread that finishes early takes the next share, so the
        # transfer does not wait for the unluckiest thread's whole share
        shares = [tuple(np.ascontiguousarray(a[t::n_shares])
                        for a in (run_fds, file_offsets, buf_offsets, lengths))
                  for t in range(n_shares)]
        pinned = np.frombuffer(buffer, np.uint8)  # holds the mapping while the kernels use it
        base = pinned.ctypes.data
        if n_shares == 1:
            _run_share(kernel, op, buffer, base, *shares[0])
            return
        futures = []
        try:
            for share in shares:
                futures.append(self._pool.submit(_run_share, kernel, op, buffer, base, *share))
            errors = [f.exception() for f in futures]
        except BaseException:
            # a Ctrl-C while the shares run: their kernels still read or write ``buffer``
            # through its address, so it must outlive them (freed under them, the memory
            # corrupts); what has not started is cancelled, what has is waited for
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            raise
        del pinned
        for e in errors:
            if e is not None:
                raise e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def check_alignment(fd: int, block_bytes: int) -> bool:
    """Whether O_DIRECT reads of ``block_bytes`` at offset 0 work on ``fd`` (the file must hold
    one block): a device whose logical block is larger refuses them with EINVAL."""
    buffer = AlignedBuffer()
    try:
        os.preadv(fd, [memoryview(buffer.get(block_bytes))[:block_bytes]], 0)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    finally:
        buffer.release()


def _run_share(kernel, op, buffer: mmap.mmap, base: int, fds: np.ndarray,
               file_offsets: np.ndarray, buf_offsets: np.ndarray, lengths: np.ndarray) -> None:
    """One thread's share of a transfer: the kernel moves every run without the GIL; a run it
    could not finish is repeated with ``op`` (os.preadv | os.pwritev), which raises the error
    with its errno (or completes, if the failure was passing), and the kernel goes on after it."""
    start = 0
    n = file_offsets.shape[0]
    while start < n:
        failed = kernel(fds[start:], base, file_offsets[start:], buf_offsets[start:],
                        lengths[start:])
        if failed < 0:
            return
        j = start + failed
        fd, off, at, length = int(fds[j]), int(file_offsets[j]), int(buf_offsets[j]), int(lengths[j])
        view = memoryview(buffer)
        done = 0
        while done < length:
            got = op(fd, [view[at + done:at + length]], off + done)
            if got <= 0:
                raise OSError(errno.EIO, f"{length - done} bytes at offset {off + done} could "
                                         "not be transferred (the file ends there)")
            done += got
        start = j + 1
