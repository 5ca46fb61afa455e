"""Row codecs for the embedding and gradient shuffles: fp32 (exact), fp16, int8 per row.

int8, per row (REFERENCE.md "Distribution", OneFlow's quantized all-to-all)::

    f = max |x|                                   (float32; the row's scale travels with it)
    q = round_half_away_from_zero(x * 127 / f)    int8 in [-127, 127]; f = 0 -> q = 0
    x^ = q * f / 127

A row holding a NaN or an inf (training has diverged) travels as f = NaN, q = 0: it decodes as all
NaN, on every backend the same, rather than as whatever an undefined float -> int8 cast gives.
Everything is evaluated in float32 in exactly this order (``x * 127`` then ``/ f``; ``q * f``
then ``/ 127``), which the CUDA kernel repeats, so both decode the same bits; except for a row
whose f exceeds ``BIG_SCALE`` (about FLT_MAX / 170), where ``x * 127`` and ``q * f`` could
overflow a finite row into inf: there ``x / f`` then ``* 127``, and ``q / 127`` then ``* f``. The
rounding is exactly half away from zero (CUDA's ``roundf``; ``trunc(s + 0.5)`` rounded
0.49999997 up, as float32 sums it to 1.0). A row travels as ``E`` int8 values
followed by the 4 bytes of ``f``: at E = 64 that is 68 bytes against fp32's 256 (0.266x).

fp16: ``x.astype(float16)`` (round to nearest even), 2 bytes a value.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import ConfigError

EXCHANGE_DTYPES = ("fp32", "fp16", "int8")

#: above this row scale f the int8 codec divides first (``x / f * 127``, ``q / 127 * f``):
#: ``x * 127`` or ``q * f`` could overflow float32 (FLT_MAX / 127 is about 2.68e36); the same
#: constant in kernels/cuda/codec.cu
BIG_SCALE = np.float32(2.0e36)

#: OneFlow's switch for int8 exchange; "1" selects int8 when no dtype is given explicitly.
QUANTIZED_COMM_ENV = "ONEFLOW_ONE_EMBEDDING_ENABLE_QUANTIZED_COMM"


def resolve_exchange_dtype(exchange_dtype: str | None) -> str:
    """The dtype named, else int8 when OneFlow's environment switch is on, else fp32."""
    if exchange_dtype is None:
        return "int8" if os.environ.get(QUANTIZED_COMM_ENV, "0").strip() == "1" else "fp32"
    if exchange_dtype not in EXCHANGE_DTYPES:
        raise ConfigError(f"exchange_dtype={exchange_dtype!r}: choose one of {EXCHANGE_DTYPES}")
    return exchange_dtype


def row_bytes(exchange_dtype: str, dim: int) -> int:
    """Bytes one row of ``dim`` values takes on the wire."""
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 4}[exchange_dtype]


def encode(rows: np.ndarray, exchange_dtype: str) -> np.ndarray:
    """rows: (n, E) float32 -> payload (n, row_bytes) uint8 (fp32: a view when contiguous)."""
    rows = np.ascontiguousarray(rows, np.float32)
    n, e = rows.shape
    if exchange_dtype == "fp32":
        return rows.view(np.uint8).reshape(n, 4 * e)
    if exchange_dtype == "fp16":
        return rows.astype(np.float16).view(np.uint8).reshape(n, 2 * e)
    scale, q = quantize_int8(rows)
    out = np.empty((n, e + 4), np.uint8)
    out[:, :e] = q.view(np.uint8)
    out[:, e:] = scale.view(np.uint8).reshape(n, 4)
    return out


def decode(payload: np.ndarray, exchange_dtype: str, dim: int) -> np.ndarray:
    """payload: (n, row_bytes) uint8 -> rows (n, dim) float32."""
    n = payload.shape[0]
    payload = np.ascontiguousarray(payload)
    if exchange_dtype == "fp32":
        return payload.view(np.float32).reshape(n, dim)
    if exchange_dtype == "fp16":
        return payload.view(np.float16).reshape(n, dim).astype(np.float32)
    q = payload[:, :dim].view(np.int8)
    scale = np.ascontiguousarray(payload[:, dim:]).view(np.float32).reshape(n)
    return dequantize_int8(scale, q)


def quantize_int8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows: (n, E) float32 -> (scale (n,) float32 = max|x|, q (n, E) int8)."""
    scale = np.abs(rows).max(axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
    finite = np.isfinite(scale)       # max |x| is NaN or inf exactly when the row holds one
    if not finite.all():              # such a row: f = NaN, q = 0 (it decodes as all NaN)
        scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
        rows = np.where(finite[:, None], rows, np.float32(0.0))
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)[:, None]
    big = safe[:, 0] > BIG_SCALE
    if big.any():   # x * 127 could overflow: those rows divide first
        scaled = np.empty_like(rows)
        scaled[~big] = (rows[~big] * np.float32(127.0)) / safe[~big]
        scaled[big] = (rows[big] / safe[big]) * np.float32(127.0)
    else:
        scaled = (rows * np.float32(127.0)) / safe
    q = round_half_away(scaled)
    return scale.astype(np.float32), np.clip(q, -127, 127).astype(np.int8)


def round_half_away(s: np.ndarray) -> np.ndarray:
    """float32 ``s`` rounded to the nearest integer, ties away from zero, exactly (CUDA's
    ``roundf``): ``s - trunc(s)`` is exact in float32, where ``trunc(s + 0.5)`` is not."""
    t = np.trunc(s)
    return t + np.where(np.abs(s - t) >= np.float32(0.5), np.sign(s), np.float32(0.0))


def dequantize_int8(scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """scale: (n,) float32, q: (n, E) int8 -> (n, E) float32 = q * scale / 127 (for a scale
    above ``BIG_SCALE``, (q / 127) * scale: q * scale could overflow)."""
    f = scale.astype(np.float32)[:, None]
    qf = q.astype(np.float32)
    big = f[:, 0] > BIG_SCALE
    if not big.any():
        return (qf * f) / np.float32(127.0)
    out = np.empty_like(qf)
    out[~big] = (qf[~big] * f[~big]) / np.float32(127.0)
    out[big] = (qf[big] / np.float32(127.0)) * f[big]
    return out
