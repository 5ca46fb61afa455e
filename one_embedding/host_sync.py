"""The one place where the host reads a device value or waits for the device, and counts it.

On a GPU every read of a device array by the host (``bool(a.any())``, ``int(a.max())``,
``a.get()``, ``float(loss)``) and every ``synchronize`` stalls the host until all work queued
before it has run: the next kernels are not queued meanwhile, so the device idles. A
steady-state training step should make none (DESIGN.md decision 14); the trainer reads its
metrics, the losses and the step's error flags, once every ``--log-interval`` steps.

Code on the step's path calls these functions instead of reading arrays directly, so that the
reads are counted wherever they happen, by reason:

    >>> import numpy as np
    >>> from one_embedding import host_sync
    >>> with host_sync.counting() as reads:
    ...     host_sync.to_host(np.arange(3), "example")
    ...     host_sync.scalar(np.float32(2.5), "example")
    array([0, 1, 2])
    2.5
    >>> reads.total, reads.by_reason["example"]
    (2, 2)

The counts cover every backend alike (a numpy "read" costs nothing, but it is counted the
same), so the CPU dry run of the device path counts what a GPU run would do.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

_lock = threading.Lock()
_totals: Counter = Counter()  # reason -> reads since the process started


def _count(reason: str) -> None:
    with _lock:
        _totals[reason] += 1


def to_host(a, reason: str, out: np.ndarray | None = None) -> np.ndarray:
    """A host numpy copy of ``a`` (device or host array), into ``out`` when given; counted."""
    _count(reason)
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        return a.get() if out is None else a.get(out=out)
    if out is None:
        return np.array(a, copy=True)
    out[...] = a
    return out


def scalar(a, reason: str):
    """The Python scalar of a 0-d or one-element array (``a.item()``); counted."""
    _count(reason)
    return a.item() if hasattr(a, "item") else a


def flag(a, reason: str) -> bool:
    """``bool(a)`` of a 0-d boolean (e.g. ``a.any()``); counted."""
    _count(reason)
    return bool(a)


def wait(event_or_stream, reason: str) -> None:
    """Block until ``event_or_stream`` (a CuPy event or stream; None: nothing) completed;
    counted when there is something to wait for."""
    if event_or_stream is None:
        return
    _count(reason)
    event_or_stream.synchronize()


def totals() -> Counter:
    """A copy of the reads counted so far in this process, by reason."""
    with _lock:
        return Counter(_totals)


@dataclass
class Reads:
    """The reads made inside one ``counting()`` block (filled when it exits)."""
    by_reason: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


@contextlib.contextmanager
def counting():
    """Count the reads made (by any thread) while inside: yields a ``Reads``, filled at exit."""
    reads = Reads()
    before = totals()
    try:
        yield reads
    finally:
        after = totals()
        after.subtract(before)
        reads.by_reason = Counter({k: v for k, v in after.items() if v > 0})
