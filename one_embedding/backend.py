"""Array backends: numpy (CPU, the reference) and CuPy (GPU).

The namespace ``xp`` is resolved once at a public entry point and passed down. CuPy arrays are
recognised by their type's module, so ``import one_embedding`` never imports cupy.
"""
from __future__ import annotations

import numpy as np


def is_cupy_array(a) -> bool:
    return type(a).__module__.split(".", 1)[0] == "cupy"


def array_namespace(*arrays):
    """The module (numpy or cupy) that owns ``arrays``; mixing the two is an error."""
    found = None
    for a in arrays:
        if a is None:
            continue
        mod = "cupy" if is_cupy_array(a) else "numpy"
        if found is not None and found != mod:
            raise TypeError("arrays mix numpy and cupy: move them to one device first")
        found = mod
    if found == "cupy":
        import cupy

        return cupy
    return np


def to_numpy(a) -> np.ndarray:
    """A host copy (or the same array when it already is numpy)."""
    if is_cupy_array(a):
        return a.get()
    return np.asarray(a)


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or no device: all mean "no GPU backend"
        return False
