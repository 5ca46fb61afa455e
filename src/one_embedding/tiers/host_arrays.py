"""Large host arrays backed by transparent huge pages where the kernel offers them.

The rows behind an index are written at scattered slots, and new keys keep touching fresh pages.
Measured on this project's 2-core VM: writing 40k rows (half new, half existing) per batch into a
10M x 128 float32 table took 42 ms on 4 KiB pages (page faults) and 4.7 ms with huge pages
advised. Memory is mapped anonymously, so it is zero-filled and only touched pages are backed,
like ``np.zeros``.
"""
from __future__ import annotations

import math
import mmap

import numpy as np

from ..errors import CapacityError

_HUGE = 2 << 20
#: below this a plain allocation is as good (and cheaper to create)
MIN_HUGE_BYTES = 8 << 20


class HostMemoryError(CapacityError, MemoryError):
    """The memory for an array was refused. A ``CapacityError``, and a ``MemoryError`` so that a
    caller that words its own message (a cache: lower cache_budget_mb) still catches it."""


def _refused(shape, dtype: np.dtype, n: int, e: BaseException) -> HostMemoryError:
    rows = (f"{shape[0]:,} rows of {math.prod(shape[1:]) * dtype.itemsize:,} bytes"
            if len(shape) > 1 else f"{n // dtype.itemsize:,} values of {dtype.itemsize} bytes")
    return HostMemoryError(
        f"cannot reserve {n / 2**20:,.0f} MB of host memory for {rows} ({e}): lower the store's "
        "capacity or embedding_dim to what this machine can hold (or use a cached store preset)"
    )


def zeros(shape, dtype) -> np.ndarray:
    """``np.zeros(shape, dtype)``, in huge-page-advised anonymous memory when it is large.
    Memory the system refuses is a ``HostMemoryError`` (a ``CapacityError``)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
    n = math.prod(shape) * dtype.itemsize  # Python ints: no int64 wrap-around
    try:
        if n < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
            return np.zeros(shape, dtype)
        buf = mmap.mmap(-1, -(-n // _HUGE) * _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (MemoryError, OSError, OverflowError) as e:
        raise _refused(shape, dtype, n, e) from None
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled: still a valid zeroed mapping
        pass
    return np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize).reshape(shape)


def full(shape, value, dtype) -> np.ndarray:
    out = zeros(shape, dtype)
    out.fill(value)
    return out
