"""What this process costs the machine, read from Linux's /proc: anonymous RAM and bytes written.

The store's budgets are stated in these terms (RAM per stored key as the growth of RssAnon,
snapshot and reopen costs as bytes written), so benchmarks and tests measure them the same way:

- ``rss_anon()``: resident anonymous memory (heap, numpy arrays, RocksDB's allocations), not
  the page cache or mapped files. ``trim_heap()`` first returns freed heap to the kernel, so the
  figure is what is in use, not what the allocator keeps around.
- ``bytes_written()``: ``write_bytes`` of /proc/self/io, the bytes this process (all its
  threads) caused to be sent to storage: O_DIRECT writes, and buffered writes as they dirty
  the page cache.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os


def physical_memory_mb() -> float | None:
    """This machine's RAM in MB (2**20 bytes), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (AttributeError, ValueError, OSError):
        return None


def rss_anon() -> int:
    """Resident anonymous memory of this process, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim_heap() -> None:
    """Collect garbage and ask glibc to return free heap pages to the kernel."""
    gc.collect()
    return_free_heap()


_LIBC = []


def return_free_heap() -> None:
    """Ask glibc (``malloc_trim``) to return the free pages of its heap to the kernel; nothing
    where there is no glibc. After a rebuild that freed large temporaries (a slot directory
    rebuilt on load: 123 MB of RssAnon for 10 M keys, against the directory's own 60 MB), the
    process's RSS is then what it holds."""
    if not _LIBC:
        name = ctypes.util.find_library("c")
        try:
            _LIBC.append(ctypes.CDLL(name).malloc_trim if name else None)
        except (OSError, AttributeError):
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](0)


def bytes_written() -> int:
    """Bytes this process has caused to be written to storage so far (0 where unknown)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
