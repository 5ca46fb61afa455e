"""Array backends: numpy (CPU, the reference) and CuPy (GPU).

The namespace ``xp`` is resolved once at a public entry point and passed down. CuPy arrays are
recognised by their type's module, so ``import one_embedding`` never imports cupy.

An embedding's device is chosen when it is built (``MultiTableEmbedding(device="cuda")``) and
held by it; code that builds embeddings for its caller (a model) picks up the default that
``embedding_device(...)`` sets for the calling thread.
"""
from __future__ import annotations

import contextlib
import logging
import reprlib
import threading

import numpy as np

from .errors import InputError

log = logging.getLogger(__name__)


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


def to_numpy(a, what: str = "array") -> np.ndarray:
    """A host copy (or the same array when it already is numpy); a ragged nested list is an
    ``InputError`` naming ``what`` (the argument: "ids", "table_ids", ...)."""
    if is_cupy_array(a):
        return a.get()
    return as_array(np, a, what)


def as_array(xp, a, what: str = "array"):
    """``xp.asarray(a)``; a ragged nested list (rows of different lengths), which numpy refuses
    with a ValueError, is an ``InputError`` naming ``what`` and the value."""
    try:
        return xp.asarray(a)
    except ValueError as e:
        pad = " (pad the short ones, e.g. with padding_idx)" if what == "ids" else ""
        raise InputError(
            f"{what}={reprlib.repr(a)} is not a rectangular array ({e}): give every row the "
            f"same length{pad}"
        ) from None


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception as e:  # no cupy, no driver, or no device: all mean "no GPU backend"
        log.debug("no GPU backend: %s: %s", type(e).__name__, e)
        return False


# ---------------------------------------------------------------- the embedding's default device

#: per thread: a thread that builds an embedding (a serving follower, a test's helper) never
#: picks up the device another thread set for its own builds (a trainer's "cuda")
_embedding_device = threading.local()


def default_embedding_device() -> str:
    """The device an embedding built without ``device=`` on this thread goes to: "cpu" unless
    this thread is inside ``embedding_device``."""
    return getattr(_embedding_device, "device", "cpu")


@contextlib.contextmanager
def embedding_device(device: str):
    """Build embeddings on ``device`` ("cpu", "cuda", "cuda:N") while inside, on this thread
    only: for code that builds its embedding itself (the models, from ``store_options``), as
    ``--device cuda`` does. Other threads keep their own default ("cpu").

        >>> with embedding_device("cpu"):
        ...     default_embedding_device()
        'cpu'
    """
    previous = default_embedding_device()
    _embedding_device.device = device
    try:
        yield device
    finally:
        _embedding_device.device = previous
