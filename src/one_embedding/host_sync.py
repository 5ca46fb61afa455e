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

Checks of values on the device (NaN inputs, labels, gradients) use ``check``: outside
``deferring`` it reads its flag at once and raises; inside (the trainer's device path) the flag
stays on the device and ``DeferredChecks.read`` raises the first failed one at the next metrics
read, naming the step, in the same read that brings the losses back.

The counts cover every backend alike (a numpy "read" costs nothing, but it is counted the
same), so the CPU dry run of the device path counts what a GPU run would do.

While a thread captures a CUDA graph (``capturing``, entered by ``cuda_graph.StepGraph``) a read
is an error: the captured kernels have not run, so there is nothing to read, and on a GPU the
capture would fail. Every function here then raises ``HostReadInCapture`` naming the read, on
every backend, and ``check`` keeps its flag for the graph instead of queueing it.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import InputError


class HostReadInCapture(RuntimeError):
    """A host read or wait while the calling thread captures a CUDA graph (``capturing``)."""


_lock = threading.Lock()
#: per thread: the capture in progress (``capturing``), or none
_capture = threading.local()
_totals: Counter = Counter()  # reason -> reads since the process started
_main_totals: Counter = Counter()  # ... of them, made by the main thread (the step's own)


def _count(reason: str) -> None:
    what = getattr(_capture, "what", None)
    if what is not None:
        raise HostReadInCapture(
            f"host read {reason!r} while capturing the CUDA graph of {what}: a captured step "
            "cannot read the device (its kernels have not run); keep the value on the device "
            "(host_sync.check inside host_sync.deferring) or leave this code out of the graph")
    on_main = threading.current_thread() is threading.main_thread()
    with _lock:
        _totals[reason] += 1
        if on_main:
            _main_totals[reason] += 1


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


def copy_async(a, out: np.ndarray) -> None:
    """Start a copy of device array ``a`` into page-locked host array ``out`` (same shape and
    dtype) on the current stream, without waiting: not a read, nothing stalls and nothing is
    counted. ``out`` holds the values once an event recorded after this call has completed
    (``Launcher.done``); read it only then. On numpy the copy is made at once."""
    what = getattr(_capture, "what", None)
    if what is not None:
        raise HostReadInCapture(f"a copy to the host while capturing the CUDA graph of {what}: "
                                "leave this code out of the graph")
    if out.shape != a.shape or out.dtype != a.dtype:
        raise InputError(f"copy_async: out {out.shape} {out.dtype} must match {a.shape} {a.dtype}")
    if type(a).__module__.startswith("cupy"):
        import cupy

        a = cupy.ascontiguousarray(a)
        cupy.cuda.runtime.memcpyAsync(out.ctypes.data, a.data.ptr, a.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost,
                                      cupy.cuda.get_current_stream().ptr)
        return
    out[...] = a


def totals(main_thread_only: bool = False) -> Counter:
    """A copy of the reads counted so far in this process, by reason (those of the main thread
    alone with ``main_thread_only``: a prefetch thread's reads do not stall the step)."""
    with _lock:
        return Counter(_main_totals if main_thread_only else _totals)


@dataclass
class Reads:
    """The reads made inside one ``counting()`` block (filled when it exits): by every thread,
    and by the main thread (the one that runs the training step)."""
    by_reason: Counter = field(default_factory=Counter)
    main_thread: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def _since(before: Counter, after: Counter) -> Counter:
    after.subtract(before)
    return Counter({k: v for k, v in after.items() if v > 0})


@contextlib.contextmanager
def counting():
    """Count the reads made (by any thread) while inside: yields a ``Reads``, filled at exit."""
    reads = Reads()
    before, before_main = totals(), totals(main_thread_only=True)
    try:
        yield reads
    finally:
        reads.by_reason = _since(before, totals())
        reads.main_thread = _since(before_main, totals(main_thread_only=True))


# ---------------------------------------------------------------- checks on the device


@dataclass
class _Check:
    step: int                    # the trainer's step when it was registered
    bad: object                  # 0-d device bool: True = the check failed
    details: tuple               # 0-d device values the message is made of
    message: Callable[..., str]  # message(*host details) -> str
    error: type
    reason: str


class DeferredChecks:
    """Checks whose flags stay on the device until ``read``: a step queues them without a
    host read; ``read`` brings every flag (and the losses beside them) back in one read and
    raises the first failed check's error, its message prefixed with its step.

    ``step`` is set by the trainer before each step; a check registered by another thread
    (the prefetcher preparing a later batch) carries the step running then.
    """

    def __init__(self):
        self.step = 0
        self._pending: list[_Check] = []
        self._lock = threading.Lock()

    def add(self, check: _Check) -> None:
        with self._lock:
            self._pending.append(check)

    def __len__(self) -> int:
        return len(self._pending)

    def read(self, xp, values=(), reason: str = "checks") -> np.ndarray:
        """values: 0-d device arrays (e.g. the pending losses) -> their host float64 values,
        read in one ``to_host`` with every pending check's flag; raises the first (oldest)
        failed check (its details read then). No read when there is nothing to read."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending and not values:
            return np.empty(0, np.float64)
        parts = [xp.asarray(v, dtype=xp.float64).reshape(1) for v in values]
        parts += [xp.asarray(c.bad, dtype=xp.float64).reshape(1) for c in pending]
        host = to_host(xp.concatenate(parts), reason)
        for c, bad in zip(pending, host[len(values):]):
            if bad:  # its details in their own dtypes (a 64-bit key does not fit a float64)
                raise c.error(f"step {c.step}: {c.message(*_read_details(c.details, c.reason))}")
        return host[:len(values)]


def _read_details(values, reason: str) -> list:
    """The Python scalars of a failed check's 0-d device details, each read in its own dtype."""
    return [to_host(v, reason + " (details)").reshape(()).item() for v in values]


_deferred: DeferredChecks | None = None


def deferred_checks() -> DeferredChecks | None:
    """The ``DeferredChecks`` that ``check`` queues into now (None: checks read at once)."""
    return _deferred


@contextlib.contextmanager
def deferring(checks: DeferredChecks):
    """Inside, ``check`` queues into ``checks`` instead of reading (one at a time: not nested)."""
    global _deferred
    if _deferred is not None:
        raise RuntimeError("host_sync.deferring is already active")
    _deferred = checks
    try:
        yield checks
    finally:
        _deferred = None


def check(bad, message: Callable[..., str], reason: str, *, details: Callable[[], tuple] = tuple,
          error: type = InputError) -> None:
    """Raise ``error(message(*host details))`` when the 0-d device bool ``bad`` is True.

    details: a callable returning 0-d device values for the message (e.g. the position and
    value of the first bad entry), called only when needed: at once after a failed read, or at
    registration inside ``deferring`` (then read with the flag, so nothing the step reuses
    later is needed to write the message). Outside ``deferring``: one counted read (two when it
    fails); inside: none until ``DeferredChecks.read``.
    """
    captured = getattr(_capture, "checks", None)
    queue = _deferred
    if captured is not None and queue is not None:  # the graph recomputes the flag each replay
        captured.append(_Check(queue.step, bad, tuple(details()), message, error, reason))
        return
    if queue is None:
        if flag(bad, reason):
            raise error(message(*_read_details(details(), reason)))
        return
    queue.add(_Check(queue.step, bad, tuple(details()), message, error, reason))


# ---------------------------------------------------------------- CUDA graph capture


@contextlib.contextmanager
def capturing(what: str):
    """While inside, this thread captures a CUDA graph of ``what``: every read raises
    ``HostReadInCapture``, and ``check`` inside ``deferring`` appends its check to the yielded
    list instead of queueing it (``cuda_graph.StepGraph`` queues a copy of each after every
    launch of the graph, whose kernels recompute the flags). Not nested."""
    if getattr(_capture, "what", None) is not None:
        raise RuntimeError(f"host_sync.capturing({what!r}) inside the capture of "
                           f"{_capture.what!r}: one capture at a time per thread")
    checks: list = []
    _capture.what, _capture.checks = what, checks
    try:
        yield checks
    finally:
        _capture.what = _capture.checks = None


def capture_in_progress() -> bool:
    """True while this thread captures a CUDA graph (inside ``capturing``)."""
    return getattr(_capture, "what", None) is not None


def requeue(check: _Check, queue: DeferredChecks, copy) -> None:
    """Queue into ``queue`` (at its current step) a check that a capture kept, with its flag and
    details copied by ``copy`` (a device copy: the next launch of the graph overwrites them)."""
    queue.add(_Check(queue.step, copy(check.bad), tuple(copy(d) for d in check.details),
                     check.message, check.error, check.reason))
