"""Stream order on the dry run: the races between CUDA streams that the device path could have.

On a GPU the prefetch thread issues its work on a stream of its own, and CuPy's memory pool
gives a freed block back at once to the stream that allocated it. Two kinds of race follow, and
both were first seen on an H200 (2026-11-27), where a dry run could not see them:

- **use after free**: an array allocated on stream P is used by work queued on stream C and
  dropped by the host before that work has run; P's next allocation may take its memory and
  P's next kernel overwrite it under C's feet (the write log's entries, the prefetched batches);
- **unordered accesses**: stream C reads (or writes) what stream P wrote, or P writes what C
  reads, with no event between them.

``checked()`` makes the dry run keep the order a GPU would keep. The stand-in ``cupy`` module's
streams become real per thread (``with stream:``), its events carry a vector clock of the work
issued before them (``Stream.record``, ``wait_event``, ``synchronize``, ``Event.done``, which
answers "not yet" the first times it is asked, as a busy GPU does), the emulated launcher takes
CuPy's stream and event calls, and every device array is a ``TrackedArray`` whose memory
(its root buffer) remembers the stream that allocated it, the last write and the reads since
by stream. Each access is checked against those (a kernel launch writes its non-const pointer
arguments and reads its const ones; CuPy functions and array operations read their inputs and
write ``out=`` / the assigned array); a freed buffer is checked at its stream's next
allocation. What the host knows has completed (a blocking read, an event's ``synchronize`` or
``done``) orders everything issued after it.

    with stream_order.checked() as hazards:
        trainer.run()
    assert not hazards, hazards     # Counter: a description of each race -> times

What it cannot see: host arrays (page-locked staging buffers written by the host while an
asynchronous copy reads them), work inside CuPy that numpy does differently, and memory that
numpy and CuPy share differently (``cupy.asarray`` of a host array copies here, as CuPy does).
"""
from __future__ import annotations

import contextlib
import random
import re
import sys
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

import hidden_syncs

_model: "Model | None" = None
#: the stream id of the host's own accesses (page-locked buffers written or read by the host)
HOST = -1
_state = threading.local()          # depth > 0: inside a tracked call (its inner ops are its own)

_STAND_INS = ("kernels/reference.py", "kernels/cpu_ops.py")
#: CuPy functions that write their first argument in place
_WRITES_FIRST = frozenset({"copyto", "put", "place", "putmask", "fill_diagonal"})
#: CuPy functions that copy a host array to the device (numpy would alias it)
_TO_DEVICE = frozenset({"asarray", "array", "ascontiguousarray", "asfortranarray"})


#: the package's launch plumbing: a frame in one of these names its caller instead
_PLUMBING = frozenset({"launch_threads", "launch_warps", "device_array", "run", "to_device",
                       "to_host", "to_host_async", "scalar", "flag", "copy_async"})


def _where() -> str:
    """The innermost frame of the package's own code outside its launch plumbing, as
    "file:line in function" (else the innermost frame outside this module and numpy)."""
    f = sys._getframe(1)
    fallback = None
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(hidden_syncs.PACKAGE_DIR) and not name.endswith(_STAND_INS) \
                and f.f_code.co_name not in _PLUMBING:
            path = "one_embedding/" + name[len(hidden_syncs.PACKAGE_DIR):]
            return f"{path}:{f.f_lineno} in {f.f_code.co_name}"
        if fallback is None and not name.endswith("stream_order.py") and "numpy" not in name \
                and "hidden_syncs" not in name and "gpu_dry_run" not in name:
            fallback = f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return fallback or "?"


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@dataclass
class _Buffer:
    """A root buffer's allocation and accesses: (stream, seq, where)."""
    alloc: int
    where: str
    last_write: tuple = None
    reads: dict = field(default_factory=dict)      # stream -> (seq, where)

    def foreign(self) -> list:
        """The accesses since the last write (and that write) made on other streams."""
        out = [(s, k, w) for s, (k, w) in self.reads.items() if s != self.alloc]
        if self.last_write is not None and self.last_write[0] != self.alloc:
            out.append(self.last_write)
        return out


class Model:
    """The streams' vector clocks, the host's knowledge, the buffers and the hazards found."""

    def __init__(self, seed: int = 0, max_lag: int = 2):
        self.lock = threading.RLock()
        self.host: dict[int, int] = {}
        # the host is a stream too: its clock is what it knows has completed (and its own
        # operations, which every later launch follows: a launch is issued after them)
        self.clocks: dict[int, dict] = {HOST: self.host}
        self.names: dict[int, str] = {0: "the null stream", HOST: "the host"}
        self.buffers: dict[int, _Buffer] = {}
        self.pending: dict[int, list] = defaultdict(list)   # alloc stream -> freed buffers
        self.hazards: Counter = Counter()
        self.seen: Counter = Counter()       # what the model saw: accesses, allocations, ...
        self._lags: dict[int, int] = {}
        self._rng = random.Random(seed)
        self._max_lag = max_lag

    # --- clocks
    def name(self, sid: int) -> str:
        return self.names.get(sid, f"stream {sid}")

    def _tick(self, sid: int) -> dict:
        clock = self.clocks.setdefault(sid, {})
        for s, k in self.host.items():
            if clock.get(s, 0) < k:
                clock[s] = k
        clock[sid] = clock.get(sid, 0) + 1
        return clock

    @staticmethod
    def _merge(into: dict, other: dict) -> None:
        for s, k in other.items():
            if into.get(s, 0) < k:
                into[s] = k

    def snapshot(self, sid: int) -> dict:
        with self.lock:
            return dict(self._tick(sid))

    def wait(self, sid: int, clock: dict | None) -> None:
        if clock is not None:
            with self.lock:
                self._merge(self.clocks.setdefault(sid, {}), clock)
                self.seen["waits"] += 1

    def host_knows(self, clock: dict | None) -> None:
        if clock is not None:
            with self.lock:
                self._merge(self.host, clock)
                self.seen["host syncs"] += 1

    def host_syncs_stream(self, sid: int) -> None:
        with self.lock:
            self.host_knows(dict(self.clocks.get(sid, {})))

    def host_syncs_device(self) -> None:
        with self.lock:
            for clock in list(self.clocks.values()):
                self.host_knows(dict(clock))

    def event_done(self, event) -> bool:
        """Not yet, the first 0..max_lag times an event is asked (drawn per event); then it
        has completed, and the host knows it."""
        with self.lock:
            key = id(event)
            if key not in self._lags:
                self._lags[key] = self._rng.randint(0, self._max_lag)
            if self._lags[key] > 0:
                self._lags[key] -= 1
                return False
            self.host_knows(event.clock)
            return True

    # --- buffers
    def adopt(self, a: np.ndarray, sid: int) -> None:
        """Register ``a``'s root buffer as allocated on ``sid`` now, if it is new."""
        root = _root(a)
        key = id(root)
        with self.lock:
            if key in self.buffers:
                return
            where = _where()
            clock = self._tick(sid)
            buf = self.buffers[key] = _Buffer(sid, where)
            buf.last_write = (sid, clock[sid], where)
            self.seen["allocations"] += 1
            self._check_freed(sid, clock, where)
        weakref.finalize(root, self._freed, key, buf)

    def _freed(self, key: int, buf: _Buffer) -> None:
        if _model is not self:
            return
        with self.lock:
            if self.buffers.get(key) is buf:
                del self.buffers[key]
            foreign = buf.foreign()
            if foreign:
                self.pending[buf.alloc].append((buf, foreign, _where()))
            self.seen["frees"] += 1

    def _check_freed(self, sid: int, clock: dict, where: str) -> None:
        """A new allocation on ``sid`` may take the memory of any buffer it freed: each such
        buffer's accesses on other streams must be known complete to ``sid``."""
        entries = self.pending.pop(sid, None)
        for buf, foreign, freed_at in entries or ():
            for s, k, w in foreign:
                if clock.get(s, 0) < k:
                    self.hazards[
                        f"use after free: memory allocated on {self.name(sid)} at {buf.where} "
                        f"and accessed on {self.name(s)} at {w} was freed at {freed_at} before "
                        f"that access was known to have run; {self.name(sid)} allocated again "
                        f"at {where}"] += 1

    def access(self, sid: int, reads, writes) -> None:
        """One operation on stream ``sid`` reading ``reads`` and writing ``writes`` (arrays)."""
        with self.lock:
            clock = self._tick(sid)
            where = None
            for arrays, write in ((reads, False), (writes, True)):
                for a in arrays:
                    buf = self.buffers.get(id(_root(a)))
                    if buf is None:
                        continue
                    where = where or _where()
                    self._check(buf, sid, clock, write, where)

    def _check(self, buf: _Buffer, sid: int, clock: dict, write: bool, where: str) -> None:
        what = "write" if write else "read"
        self.seen["accesses"] += 1
        lw = buf.last_write
        if lw is not None and lw[0] != sid and clock.get(lw[0], 0) < lw[1]:
            self.hazards[f"unordered: a {what} on {self.name(sid)} at {where} of memory "
                         f"allocated at {buf.where}, after a write on {self.name(lw[0])} at "
                         f"{lw[2]} with no event between"] += 1
        if write:
            for s, (k, w) in buf.reads.items():
                if s != sid and clock.get(s, 0) < k:
                    self.hazards[f"unordered: a write on {self.name(sid)} at {where} of memory "
                                 f"allocated at {buf.where}, after a read on {self.name(s)} at "
                                 f"{w} with no event between"] += 1
            buf.last_write = (sid, clock[sid], where)
            buf.reads = {}
        else:
            buf.reads[sid] = (clock[sid], where)


# ---------------------------------------------------------------- the arrays


def _current() -> int:
    import gpu_dry_run

    return gpu_dry_run.current_stream_id()


def _arrays(values) -> list:
    out = []
    for v in values:
        if isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_arrays(v))
    return out


def _inside():
    """Inside a tracked operation: the operations it is made of are its own."""
    return hidden_syncs.nested(_state)


def _active() -> "Model | None":
    return None if getattr(_state, "depth", 0) else _model


def _record(reads, writes=()) -> None:
    m = _active()
    if m is not None:
        m.access(_current(), _arrays(reads), _arrays(writes))


def _host_read(a, write: bool = False) -> None:
    """A read the host waits for (CuPy copies on the current stream and synchronizes it);
    ``write``: the host buffer it copies into."""
    m = _active()
    if m is not None:
        sid = _current()
        m.access(sid, [] if write else [a], [a] if write else [])
        m.host_syncs_stream(sid)


def tracked(value):
    """Arrays (and numpy scalars, as 0-d arrays) as TrackedArray; tuples and lists element by
    element; anything else as it is."""
    return hidden_syncs.to_device(value, TrackedArray)


def _ufunc(record, wrap, ufunc, method, inputs, out, kwargs):
    """A ufunc call on plain arrays, its accesses given to ``record`` first: it reads its inputs
    and writes ``out`` (``ufunc.at``: its first input); a new result goes through ``wrap``."""
    writes = list(out) if out is not None else ([inputs[0]] if method == "at" else [])
    record([*inputs, *kwargs.values()], writes)
    if out is not None:
        kwargs["out"] = tuple(_plain(o) for o in out)
    with _inside():
        result = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
    if method == "at":
        return None
    if out is not None:
        return out[0] if len(out) == 1 else out
    return wrap(result)


def _call_accesses(name: str, args, kwargs) -> tuple[list, list]:
    """(reads, writes) of numpy / CuPy function ``name``: it reads its arguments and writes
    ``out=``; the in-place ones (``_WRITES_FIRST``) write their first argument instead."""
    out = kwargs.get("out")
    first = name in _WRITES_FIRST and bool(args)
    reads = [*args[first:], *(v for k, v in kwargs.items() if k != "out")]
    return reads, ([out] if out is not None else []) + ([args[0]] if first else [])


def _method(name: str, record, write_self: bool = False, wrap=lambda result: result):
    """ndarray method ``name`` on the plain array, its accesses given to ``record`` first: it
    reads its arguments and reads (or with ``write_self`` writes) the array itself."""
    def method(self, *args, **kwargs):
        others = [*args, *kwargs.values()]
        record(others if write_self else [self, *others], [self] if write_self else [])
        with _inside():
            return wrap(getattr(np.ndarray, name)(self.view(np.ndarray), *args, **kwargs))
    method.__name__ = name
    return method


def _plain(v):
    if isinstance(v, np.ndarray) and type(v) is not np.ndarray:
        return v.view(np.ndarray)
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return v


class TrackedArray(hidden_syncs.DeviceArray):
    """A numpy array standing in for a ``cupy.ndarray`` under ``checked()``: its root buffer's
    stream and accesses are kept (see the module docstring)."""

    def __array_finalize__(self, obj):
        m = _model
        if m is not None:
            m.adopt(self, _current())

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        return arr.view(TrackedArray) if type(arr) is not TrackedArray else arr

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        return _ufunc(_record, tracked, ufunc, method, inputs, out, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        # numpy functions called on device arrays directly (np.dot, np.concatenate, ...): they
        # read their arguments and write ``out=`` (and the first argument of the in-place ones)
        _record(*_call_accesses(func.__name__, args, kwargs))
        with _inside():
            return super().__array_function__(func, types, args, kwargs)

    def __getitem__(self, key):
        _record([self, key])
        with _inside():
            return super().__getitem__(key)

    def __setitem__(self, key, value):
        _record([key, value], [self])
        with _inside():
            super().__setitem__(key, value)

    copy = _method("copy", _record, wrap=tracked)
    astype = _method("astype", _record, wrap=tracked)
    take = _method("take", _record, wrap=tracked)
    argsort = _method("argsort", _record, wrap=tracked)
    flatten = _method("flatten", _record, wrap=tracked)
    fill = _method("fill", _record, write_self=True)
    sort = _method("sort", _record, write_self=True)
    put = _method("put", _record, write_self=True)

    def __bool__(self):
        _host_read(self)
        return super().__bool__()

    def __int__(self):
        _host_read(self)
        return super().__int__()

    def __float__(self):
        _host_read(self)
        return super().__float__()

    def item(self, *args):
        _host_read(self)
        return super().item(*args)

    def tolist(self):
        _host_read(self)
        return super().tolist()


def _host_record(reads, writes=()) -> None:
    m = _active()
    if m is not None:
        m.access(HOST, _arrays(reads), _arrays(writes))


class HostArray(np.ndarray):
    """A page-locked host buffer (``Launcher.host_empty``) under ``checked()``: the host's own
    reads and writes of it are accesses of the host, which must follow the asynchronous copies
    into or out of it that it knows have completed. Results of operations on it are plain
    host arrays."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        return _ufunc(_host_record, lambda result: result, ufunc, method, inputs, out, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        _host_record(*_call_accesses(func.__name__, args, kwargs))
        with _inside():
            return func(*(_plain(a) for a in args),
                        **{k: _plain(v) for k, v in kwargs.items()})

    def __getitem__(self, key):
        _host_record([self, key])
        with _inside():
            return np.ndarray.__getitem__(self.view(np.ndarray), key)

    def __setitem__(self, key, value):
        _host_record([key, value], [self])
        with _inside():
            np.ndarray.__setitem__(self.view(np.ndarray), key, value)

    copy = _method("copy", _host_record)
    astype = _method("astype", _host_record)
    tobytes = _method("tobytes", _host_record)
    tolist = _method("tolist", _host_record)
    item = _method("item", _host_record)


def _tracked_call(name, fn):
    """CuPy function ``name`` (numpy's ``fn``): reads its array arguments, writes ``out=`` (and
    the first argument of the in-place ones), returns TrackedArray."""
    def call(*args, **kwargs):
        if _active() is None:
            return tracked(fn(*args, **kwargs))
        if name in _TO_DEVICE and args and type(args[0]) is np.ndarray:
            args = (np.array(args[0], copy=True), *args[1:])   # CuPy copies host data up
        _record(*_call_accesses(name, args, kwargs))
        with _inside():
            return tracked(fn(*args, **kwargs))

    call.__name__ = name
    return call


# ---------------------------------------------------------------- kernels


def kernel_pointer_constness(families) -> dict:
    """{kernel: [True (const pointer: read), False (pointer: written), None (a value)]} from the
    families' CUDA sources."""
    from cuda_emulation import _source_file, _strip_comments

    out = {}
    for family in families:
        text = _strip_comments(_source_file(family, None).read_text())
        for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", text):
            out[name] = [("const" in p) if "*" in p else None for p in params.split(",")]
    return out


@contextlib.contextmanager
def checked(seed: int = 0, max_lag: int = 2):
    """Check the stream order of everything the dry run's device path does inside the block;
    yields the Counter of hazards (filled as they are found). ``seed`` draws how many times
    each event answers ``done`` with "not yet" (0..``max_lag``)."""
    global _model
    from one_embedding import host_sync
    from one_embedding.kernels import cuda_module as cm
    from one_embedding.kernels import device_ops

    cupy = sys.modules["cupy"]
    launcher = device_ops.cupy_launcher()
    consts = kernel_pointer_constness(cm.EMBEDDING_FAMILIES + cm.DATA_FAMILIES + cm.AMP_FAMILIES)
    model = Model(seed, max_lag)
    outer = _model
    saved_getattr = cupy.__dict__["__getattr__"]
    saved_launcher = {n: launcher.__dict__.get(n) for n in
                      ("xp", "run", "stream", "record", "wait", "synchronize", "done",
                       "host_empty")}
    saved_sync = {n: getattr(host_sync, n) for n in ("to_host", "scalar", "flag", "copy_async")}
    tracked_np = hidden_syncs.WrappedNamespace(np, _tracked_call)
    base_run = launcher.run

    def run(family, name, dtype, grid, block, args):
        kinds = consts.get(f"{family}_{name}") or consts.get(name) or [None] * len(args)
        reads = [a for a, c in zip(args, kinds) if c is True]
        writes = [a for a, c in zip(args, kinds) if c is False]
        _record(reads, writes)
        with _inside():
            return base_run(family, name, dtype, grid, block, args)

    def host_read(fn):
        def call(a, *args, **kwargs):      # (a, reason[, out])
            out = kwargs.get("out", args[1] if len(args) > 1 else None)
            _host_read(a)
            if isinstance(out, np.ndarray):
                _host_read(out, write=True)
            with _inside():
                return fn(a, *args, **kwargs)
        return call

    def async_copy(a, out):
        _record([a], [out])
        with _inside():
            return saved_sync["copy_async"](a, out)

    @contextlib.contextmanager
    def stream():
        with cupy.cuda.Stream(non_blocking=True) as s:
            yield s

    def wait(event):
        if event is not None:
            cupy.cuda.get_current_stream().wait_event(event)

    def host_empty(shape, dtype):
        buf = np.empty(shape, dtype).view(HostArray)      # host memory, not a device array
        model.adopt(buf, HOST)
        return buf

    cupy.__dict__["__getattr__"] = lambda name: getattr(tracked_np, name)
    launcher.host_empty = host_empty
    launcher.xp = hidden_syncs.WrappedNamespace(launcher.xp, _tracked_call)
    launcher.run = run
    launcher.stream = stream
    launcher.record = lambda: cupy.cuda.get_current_stream().record()
    launcher.wait = wait
    launcher.synchronize = lambda event, reason="launcher.synchronize": host_sync.wait(event,
                                                                                       reason)
    launcher.done = lambda event: event is None or bool(event.done)
    for n in ("to_host", "scalar", "flag"):
        setattr(host_sync, n, host_read(saved_sync[n]))
    host_sync.copy_async = async_copy
    _model = model
    try:
        yield model.hazards
    finally:
        _model = outer
        cupy.__dict__["__getattr__"] = saved_getattr
        for n, v in saved_launcher.items():
            if v is None:
                launcher.__dict__.pop(n, None)
            else:
                launcher.__dict__[n] = v
        for n, fn in saved_sync.items():
            setattr(host_sync, n, fn)
        checked.last = model


checked.last = None


def active_model() -> "Model | None":
    return _model
