"""The exchange's row codecs on device arrays (``cuda/codec.cu``): the device twins of
``parallel.codec.encode`` / ``decode``, byte for byte. Every function takes ``launch``, a
``device_ops.Launcher`` (CuPy on the GPU, the host emulator in the tests)."""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError, InputError
from .device_ops import Launcher, _float_dtype, device_array, launch_threads, launch_warps, resolve


def encode(rows, exchange_dtype: str, launch: Launcher | None = None):
    """rows: (n, E) float -> payload (n, row_bytes) uint8, byte for byte ``parallel.codec.encode``.

    fp32: a view of the float32 rows; fp16: round to nearest even on the bits (exact, whatever
    the flush mode); int8: per-row scale and quantization in float32 in codec.py's order (a row
    whose values are float32-subnormal may quantize differently under flush-to-zero).
    """
    launch = resolve(launch)
    xp = launch.xp
    rows = device_array(launch, "rows", rows, None, ndim=2)
    dtype = _float_dtype("rows", rows)
    n, dim = rows.shape
    if exchange_dtype == "fp32":
        if n * dim == 0:
            return xp.empty((n, 4 * dim), dtype=xp.uint8)
        return xp.ascontiguousarray(rows, dtype=xp.float32).view(xp.uint8).reshape(n, 4 * dim)
    if exchange_dtype == "fp16":
        payload = xp.empty((n, 2 * dim), dtype=xp.uint8)
        if n * dim:
            launch_threads(launch, "codec", "fp16_encode", dtype, n * dim,
                           (rows, np.int64(n * dim), payload.view(xp.uint16)))
        return payload
    if exchange_dtype == "int8":
        payload = xp.empty((n, dim + 4), dtype=xp.uint8)
        launch_warps(launch, "codec", "int8_encode", dtype, n, (rows, np.int64(n), np.int32(dim), payload))
        return payload
    raise ConfigError(f"exchange_dtype={exchange_dtype!r}: choose fp32, fp16 or int8")


def decode(payload, exchange_dtype: str, dim: int, launch: Launcher | None = None):
    """payload: (n, row_bytes) uint8 -> rows (n, dim) float32, as ``parallel.codec.decode``."""
    launch = resolve(launch)
    xp = launch.xp
    payload = device_array(launch, "payload", payload, np.uint8, ndim=2)
    n = payload.shape[0]
    dim = int(dim)
    width = {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 4}.get(exchange_dtype)
    if width is None:
        raise ConfigError(f"exchange_dtype={exchange_dtype!r}: choose fp32, fp16 or int8")
    if payload.shape[1] != width:
        raise InputError(f"payload rows of {payload.shape[1]} bytes are not {exchange_dtype} rows "
                         f"of dim {dim} ({width} bytes)")
    out = xp.empty((n, dim), dtype=xp.float32)
    if n * dim == 0:
        return out
    if exchange_dtype == "fp32":
        return payload.view(xp.float32).reshape(n, dim)
    if exchange_dtype == "fp16":
        launch_threads(launch, "codec", "fp16_decode", np.float32, n * dim,
                       (payload.view(xp.uint16), np.int64(n * dim), out))
    else:
        launch_threads(launch, "codec", "int8_decode", np.float32, n * dim,
                       (payload, np.int64(n), np.int32(dim), out))
    return out
