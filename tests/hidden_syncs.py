"""Implicit device-to-host reads on the dry run: what ``host_sync`` cannot count.

On a GPU, CuPy reads the device behind the caller's back in some places: ``bool(a)``,
``int(a)``, ``float(a)``, ``a.item()``, ``a.tolist()``, iterating an array, indexing or
assigning through a boolean mask (the output's size is the mask's count), and the functions in
``SYNCING`` (their output size or an argument check depends on device data; each is read off
CuPy's own source). Each one stalls the host until the device has caught up, like a counted
read, but nothing counts it. On the dry run numpy stands in for CuPy and these are free, so a
step could be full of them and no test would see it.

``strict()`` makes the dry run see them: while it is active, the stand-in ``cupy`` module and
the emulated launcher return ``DeviceArray`` (a numpy array that records each such operation,
with the first line of the package that made it) and keep 0-d results as arrays, as CuPy does,
so ``if a.any():`` records a read where CuPy would make one. Reads made through ``host_sync``
(counted there) and the emulator's own handling of kernel arguments are not recorded.

    with hidden_syncs.strict() as seen:
        trainer.run()
    assert not seen, seen       # Counter: "what at file:line in function" -> times
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import traceback
from collections import Counter

import numpy as np

#: CuPy functions that read the device to size their output or to check an argument (CuPy 13/14
#: source): nonzero and what is built on it (flatnonzero, argwhere, compress, extract, place,
#: unique's mask, boolean indexing), bincount (``(x < 0).any()`` and ``int(cupy.max(x))``)
SYNCING = frozenset({"nonzero", "flatnonzero", "argwhere", "compress", "extract", "place",
                     "unique", "bincount"})

_state = threading.local()          # depth > 0: a read host_sync counts or the emulator makes
_seen: Counter | None = None        # the active strict() block's records, None outside one
_lock = threading.Lock()
#: where the package's own source lies: a frame is the package's when its file starts so (a
#: name test would also take numpy inside a virtual environment called one_embedding_*)
PACKAGE_DIR = os.path.dirname(importlib.util.find_spec("one_embedding").origin) + os.sep


def active() -> bool:
    return _seen is not None


@contextlib.contextmanager
def nested(state: threading.local):
    """``state.depth`` one deeper for the calling thread while inside."""
    state.depth = getattr(state, "depth", 0) + 1
    try:
        yield
    finally:
        state.depth -= 1


def quiet():
    """Reads inside are accounted elsewhere (host_sync) or are the emulator's own."""
    return nested(_state)


#: the numpy kernels that stand in on the dry run for the dense layers' CuPy module
#: (``kernels/cuda_ops.py``, which returns device arrays and runs only on a GPU): their host
#: scalars are the stand-in's, not the GPU path's
_STAND_INS = ("kernels/reference.py", "kernels/cpu_ops.py")


def _where():
    """The innermost frame of the package's own code (else of the caller outside numpy), as
    "file:line in function", or None inside a stand-in kernel module."""
    frames = traceback.extract_stack()[:-3]
    mine = [f for f in frames if f.filename.startswith(PACKAGE_DIR)]
    f = (mine or [f for f in frames if "numpy" not in f.filename] or frames)[-1]
    path = (f"one_embedding/{f.filename[len(PACKAGE_DIR):]}" if f.filename.startswith(PACKAGE_DIR)
            else f.filename)
    if path.endswith(_STAND_INS):
        return None
    return f"{path}:{f.lineno} in {f.name}"


def record(what: str) -> None:
    if _seen is None or getattr(_state, "depth", 0):
        return
    where = _where()
    if where is None:
        return
    key = f"{what} at {where}"
    with _lock:
        _seen[key] += 1


def _is_bool_mask(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.dtype == np.bool_ and k.ndim > 0 for k in keys)


def to_device(value, cls=None):
    """ndarrays and numpy scalars as DeviceArray (or ``cls``; scalars 0-d, as CuPy returns
    them); tuples and lists element by element; anything else as it is."""
    cls = cls or DeviceArray
    if type(value) is np.ndarray:
        return value.view(cls)
    if isinstance(value, np.generic):
        return np.asarray(value).view(cls)
    if isinstance(value, tuple):
        return tuple(to_device(v, cls) for v in value)
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        return [to_device(v, cls) for v in value]
    return value


class DeviceArray(np.ndarray):
    """A numpy array standing in for a ``cupy.ndarray`` under ``strict()``: records each
    operation that makes CuPy read the device (see the module docstring)."""

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        # CuPy never turns a result into a host scalar: 0-d results stay arrays
        return arr.view(DeviceArray) if type(arr) is not DeviceArray else arr

    # indexing by device arrays reads nothing in CuPy (an integer index array, 0-d too, is an
    # advanced index), but numpy takes a 0-d one's value with __index__: not recorded
    def __getitem__(self, key):
        if _is_bool_mask(key):
            record("boolean-mask indexing")
        with quiet():
            return to_device(super().__getitem__(key))

    def __setitem__(self, key, value):
        if _is_bool_mask(key):
            record("boolean-mask assignment")
        with quiet():
            super().__setitem__(key, value)

    def __bool__(self):
        record("bool()")
        return super().__bool__()

    def __int__(self):
        record("int()")
        return super().__int__()

    def __index__(self):
        record("int() (as an index)")
        return super().__index__()

    def __float__(self):
        record("float()")
        return super().__float__()

    def item(self, *args):
        record(".item()")
        return super().item(*args)

    def tolist(self):
        record(".tolist()")
        return super().tolist()

    def __iter__(self):
        record("iteration")
        return super().__iter__()

    def nonzero(self):
        record(".nonzero()")
        return to_device(super().nonzero())


class WrappedNamespace:
    """``base`` (numpy, or the emulator's numpy) whose functions are called through
    ``wrap(name, function)`` (which returns the function to call); types and constants pass
    through unchanged. Also ``scripts/step_census.py``'s way of seeing each cupy call."""

    def __init__(self, base, wrap):
        self._base, self._wrap = base, wrap

    def __getattr__(self, name):
        attr = getattr(self._base, name)
        if isinstance(attr, type) or not callable(attr):
            return attr
        return self._wrap(name, attr)


def _strict_call(name, fn):
    """``fn`` returning DeviceArray, recording a call of the ``SYNCING`` ones."""
    def call(*args, **kwargs):
        if name not in SYNCING:
            return to_device(fn(*args, **kwargs))
        record(f"{name}()")
        with quiet():   # one read, recorded once (numpy's nonzero calls the method)
            return to_device(fn(*args, **kwargs))

    call.__name__ = name
    return call


@contextlib.contextmanager
def strict():
    """Record hidden reads (a Counter, yielded) until the block ends: the stand-in cupy module
    and the emulated launcher hand out DeviceArray meanwhile; host_sync's reads are exempt."""
    global _seen
    from one_embedding import host_sync
    from one_embedding.kernels import device_ops

    cupy = sys.modules["cupy"]
    launcher = device_ops.cupy_launcher()
    saved_getattr = cupy.__dict__["__getattr__"]
    saved_xp, saved_run = launcher.xp, launcher.run
    saved_sync = {name: getattr(host_sync, name)
                  for name in ("to_host", "scalar", "flag", "wait", "copy_async")}
    strict_np = WrappedNamespace(np, _strict_call)

    def exempt(fn):
        def call(*args, **kwargs):
            with quiet():
                return fn(*args, **kwargs)
        return call

    seen: Counter = Counter()
    cupy.__dict__["__getattr__"] = lambda name: getattr(strict_np, name)
    launcher.xp = WrappedNamespace(saved_xp, _strict_call)
    launcher.run = exempt(saved_run)
    for name, fn in saved_sync.items():
        setattr(host_sync, name, exempt(fn))
    _seen = seen
    try:
        yield seen
    finally:
        _seen = None
        cupy.__dict__["__getattr__"] = saved_getattr
        launcher.xp, launcher.run = saved_xp, saved_run
        for name, fn in saved_sync.items():
            setattr(host_sync, name, fn)
