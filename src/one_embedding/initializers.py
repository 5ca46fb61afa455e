"""Deterministic, counter-based initial values: value = f(seed, key, column, initializer).

A new key's row does not depend on rank, tier, batch position or time (REFERENCE.md). Each value
comes from hashing the counter (seed, key, column, stream) with splitmix64 in uint64 arithmetic,
which numpy and CuPy evaluate bit-identically; the float math after it is done in float64 and
rounded to float32 once.

Hash: ``h = mix(mix(mix(seed ^ SEED_SALT) ^ key) + (column << 8 | stream) * GOLDEN)`` with
``mix`` the splitmix64 finalizer (``hashing.mix64``). ``uniform01(h) = (h >> 11) * 2**-53`` in [0, 1).
Normal values use Box-Muller on streams (2k, 2k+1); truncated normal values use rejection over
up to ``TRUNC_NORMAL_TRIES`` stream pairs, then clip (the probability of reaching the clip is
below 1e-12 for bounds at +-2 std).
"""
from __future__ import annotations

import numpy as np

from .hashing import GOLDEN, MIX1, MIX2, jit_mix64, mix64
from .options import (
    ConstantInitializer,
    Initializer,
    NormalInitializer,
    TruncNormalInitializer,
    UniformInitializer,
)

SEED_SALT = 0x5851F42D4C957F2D
TRUNC_NORMAL_TRIES = 8

#: This module's historical name for the splitmix64 *finalizer* ``hashing.mix64`` (no golden-ratio
#: increment, unlike ``hashing.splitmix64``); kept for ``kernels.reference`` and user code.
splitmix64 = mix64
__all__ = ["GOLDEN", "MIX1", "MIX2", "SEED_SALT", "counter_hash", "fill_initial_values",
           "initial_values", "splitmix64", "uniform01"]


def counter_hash(xp, seed: int, keys, columns, stream: int = 0):
    """uint64 hash of (seed, key, column, stream).

    keys: (n,) uint64; columns: (E,) uint64 -> (n, E) uint64. ``stream`` < 256 selects independent
    sequences for the same (key, column).
    """
    s = mix64(xp, xp.asarray([(int(seed) ^ SEED_SALT) & 0xFFFFFFFFFFFFFFFF], dtype=xp.uint64))
    k = mix64(xp, keys.astype(xp.uint64)[:, None] ^ s)
    c = ((columns.astype(xp.uint64) << xp.uint64(8)) | xp.uint64(stream)) * xp.uint64(GOLDEN)
    return mix64(xp, k + c[None, :])


def uniform01(xp, h):
    """uint64 hash -> float64 uniform in [0, 1) from its top 53 bits."""
    return (h >> xp.uint64(11)).astype(xp.float64) * (1.0 / 9007199254740992.0)


def _standard_normal(xp, seed, keys, columns, pair: int):
    u1 = uniform01(xp, counter_hash(xp, seed, keys, columns, 2 * pair))
    u2 = uniform01(xp, counter_hash(xp, seed, keys, columns, 2 * pair + 1))
    # 1 - u1 lies in (0, 1], so the log is finite
    return xp.sqrt(-2.0 * xp.log1p(-u1)) * xp.cos(2.0 * np.pi * u2)


def initial_values(xp, init: Initializer, seed: int, keys, columns):
    """Initial values of ``keys`` (n,) uint64 at ``columns`` (E,) -> (n, E) float32."""
    n, e = keys.shape[0], columns.shape[0]
    if isinstance(init, ConstantInitializer):
        return xp.full((n, e), init.value, dtype=xp.float32)
    if isinstance(init, UniformInitializer):
        u = uniform01(xp, counter_hash(xp, seed, keys, columns, 0))
        return (init.low + (init.high - init.low) * u).astype(xp.float32)
    if isinstance(init, NormalInitializer):
        return (init.mean + init.std * _standard_normal(xp, seed, keys, columns, 0)).astype(xp.float32)
    if isinstance(init, TruncNormalInitializer):
        out = xp.full((n, e), xp.nan, dtype=xp.float64)
        for pair in range(TRUNC_NORMAL_TRIES):
            x = init.mean + init.std * _standard_normal(xp, seed, keys, columns, pair)
            take = xp.isnan(out) & (x >= init.a) & (x <= init.b)
            out = xp.where(take, x, out)
        out = xp.where(xp.isnan(out), xp.clip(init.mean, init.a, init.b), out)
        # float32 rounding may step just outside [a, b]: clamp in float32
        return xp.clip(out.astype(xp.float32), xp.float32(init.a), xp.float32(init.b))
    raise TypeError(f"unknown initializer {init!r}")


# ---------------------------------------------------------------- compiled CPU kernel
# The same counter hash and transforms, fused per element, for the CPU hot path (new keys arrive
# every step under Zipf traffic). numpy above stays the reference and the CuPy path; float64 libm
# results can differ from numpy's in the last ulp, which survives the float32 rounding only rarely
# (tests bound it at 1 float32 ulp).
from numba import njit  # noqa: E402

_KIND = {ConstantInitializer: 0, UniformInitializer: 1, NormalInitializer: 2, TruncNormalInitializer: 3}


@njit(cache=True, nogil=True, inline="always")
def _u01(key_mix, col, stream):
    c = ((np.uint64(col) << np.uint64(8)) | np.uint64(stream)) * np.uint64(GOLDEN)
    return np.float64(jit_mix64(key_mix + c) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True, nogil=True, inline="always")
def _normal(key_mix, col, pair):
    u1 = _u01(key_mix, col, 2 * pair)
    u2 = _u01(key_mix, col, 2 * pair + 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


@njit(cache=True, nogil=True)
def _fill_initial(lines, rows, keys, col_start, n_cols, out_offset, seed_mix, kind, p0, p1, p2, p3):
    """lines[rows[i], out_offset + j] = init(keys[i], col_start + j) for j < n_cols."""
    for i in range(rows.shape[0]):
        km = jit_mix64(keys[i] ^ seed_mix)
        r = rows[i]
        for j in range(n_cols):
            col = col_start + j
            if kind == 0:
                v = p0
            elif kind == 1:
                v = p0 + (p1 - p0) * _u01(km, col, 0)
            elif kind == 2:
                v = p0 + p1 * _normal(km, col, 0)
            else:
                v = np.nan
                for pair in range(TRUNC_NORMAL_TRIES):
                    x = p0 + p1 * _normal(km, col, pair)
                    if x >= p2 and x <= p3:
                        v = x
                        break
                if np.isnan(v):
                    v = min(max(p0, p2), p3)
            f = np.float32(v)
            if kind == 3:
                f = min(max(f, np.float32(p2)), np.float32(p3))
            lines[r, out_offset + j] = f


def fill_initial_values(lines: np.ndarray, rows: np.ndarray, keys: np.ndarray, init: Initializer,
                        seed: int, col_start: int, n_cols: int, out_offset: int) -> None:
    """CPU kernel: ``lines[rows, out_offset:out_offset+n_cols]`` = initial values of ``keys`` at
    columns ``col_start..col_start+n_cols-1``. lines: (n, L) float32; rows: (m,) int64; keys: (m,)
    uint64."""
    params = [0.0, 0.0, 0.0, 0.0]
    if isinstance(init, ConstantInitializer):
        params[0] = init.value
    elif isinstance(init, UniformInitializer):
        params[:2] = init.low, init.high
    elif isinstance(init, NormalInitializer):
        params[:2] = init.mean, init.std
    else:
        params[:] = init.mean, init.std, init.a, init.b
    seed_mix = mix64(np, np.array([(int(seed) ^ SEED_SALT) & 0xFFFFFFFFFFFFFFFF], np.uint64))[0]
    _fill_initial(lines, np.ascontiguousarray(rows, np.int64), np.ascontiguousarray(keys, np.uint64),
                  col_start, n_cols, out_offset, np.uint64(seed_mix), _KIND[type(init)], *map(float, params))
