"""Fused operators in numpy: the specification the CUDA kernels (``cuda_ops``) are checked against.

Every function here has a twin of the same name and signature in ``cuda_ops`` (the contract in
KERNEL_API). Arrays are C-contiguous; float32 is the working dtype, and float64 is accepted
everywhere so that gradients can be checked by finite differences. Outputs keep the input dtype.

``bias_act_forward`` consumes its ``h`` (the caller's fresh matmul output): the result may share
its memory. That saves one (B, N) temporary per layer, which is most of the elementwise cost of
an MLP on CPU. No other function writes into its arguments.

"mask" objects are opaque: produced by a forward here and consumed only by the backward here
(numpy: a bool array of the output's shape).

Dropout's randomness is spelled out in numpy by ``dropout_uniform``; ``dropout_forward`` evaluates
the same uint64 hash per element in a compiled (numba) loop, tested equal to it bit for bit.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from ..initializers import GOLDEN, MIX1, MIX2, SEED_SALT, counter_hash, splitmix64, uniform01

# ---------------------------------------------------------------- bias + activation


def bias_act_forward(h, b, relu):
    """``y = relu(h + b)`` (or ``h + b``), computed in place in ``h``.

    h: (B, N) float matmul output (overwritten); b: (N,) same dtype; relu: bool
    -> (y (B, N), mask (B, N) bool with mask = y > 0, or None when not relu)
    """
    np.add(h, b, out=h)
    if not relu:
        return h, None
    np.maximum(h, 0, out=h)
    return h, h > 0


def bias_act_backward(dy, mask):
    """dy: (B, N); mask from ``bias_act_forward`` -> (dh (B, N), db (N,)); dh = dy * mask."""
    dh = dy if mask is None else np.multiply(dy, mask, dtype=dy.dtype)
    return dh, dh.sum(axis=0)


# ---------------------------------------------------------------- dropout


def dropout_uniform(shape, seed, step):
    """The counter-based uniforms of a dropout call: (B, N) float64 in [0, 1).

    u[i] = uniform01(counter_hash(seed, key=step, column=i, stream=0)) with i the flat element
    index, so numpy and CUDA draw the same numbers.
    """
    n = int(np.prod(shape))
    h = counter_hash(np, seed, np.asarray([step], dtype=np.uint64), np.arange(n, dtype=np.uint64), 0)
    return uniform01(np, h).reshape(shape)


def _dropout_counter_key(seed, step):
    """The per-call half of counter_hash: splitmix64(splitmix64(seed ^ SALT) ^ step), uint64."""
    s = splitmix64(np, np.asarray([(int(seed) ^ SEED_SALT) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return splitmix64(np, np.asarray([step], dtype=np.uint64) ^ s)[0]


_U64 = np.uint64
_GOLDEN, _MIX1, _MIX2 = _U64(GOLDEN), _U64(MIX1), _U64(MIX2)


@njit(cache=True, nogil=True)
def _dropout_apply(x, key, rate, scale, y, keep):  # pragma: no cover - compiled
    # counter_hash(seed, key=step, column=i, stream=0) for each flat index i, then uniform01 > rate;
    # the same uint64 operations as initializers.counter_hash, element by element
    for i in range(x.size):
        z = key + ((_U64(i) << _U64(8)) * _GOLDEN)
        z = (z ^ (z >> _U64(30))) * _MIX1
        z = (z ^ (z >> _U64(27))) * _MIX2
        z = z ^ (z >> _U64(31))
        k = (z >> _U64(11)) * (1.0 / 9007199254740992.0) > rate
        keep[i] = k
        y[i] = x[i] * scale if k else x[i] * 0  # x * 0, not 0: NaN stays NaN as in x * keep


def dropout_forward(x, rate, seed, step):
    """x: (B, N) -> (y (B, N), keep_mask (B, N) bool); keep where u > rate, y = x * keep / (1 - rate).

    u = ``dropout_uniform(x.shape, seed, step)``; a compiled loop evaluates the same hash per
    element without the (B, N) uint64 temporaries (it is 3x a same-size matmul otherwise).
    """
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    keep = np.empty(x.shape, dtype=np.bool_)
    scale = x.dtype.type(1.0 / (1.0 - rate))
    _dropout_apply(x.reshape(-1), _dropout_counter_key(seed, step), float(rate), scale,
                   y.reshape(-1), keep.reshape(-1))
    return y, keep


def dropout_backward(dy, keep_mask, rate):
    """dy: (B, N), keep_mask from ``dropout_forward`` -> dx (B, N) = dy * keep / (1 - rate)."""
    dx = np.multiply(dy, keep_mask, dtype=dy.dtype)
    dx *= dy.dtype.type(1.0 / (1.0 - rate))
    return dx


# ---------------------------------------------------------------- dot interaction


@lru_cache(maxsize=64)
def interaction_pairs(num_features, self_interaction):
    """Row and column indices of the kept entries of Z = X Xᵀ, in output order.

    Pairs (r, c) with c < r (c <= r with self_interaction), row-major:
    (1,0), (2,0), (2,1), (3,0), ... -> (rows (P,) intp, cols (P,) intp)
    """
    rows, cols = [], []
    for r in range(num_features):
        for c in range(r + 1 if self_interaction else r):
            rows.append(r)
            cols.append(c)
    rows, cols = np.asarray(rows, dtype=np.intp), np.asarray(cols, dtype=np.intp)
    rows.flags.writeable = False
    cols.flags.writeable = False
    return rows, cols


@lru_cache(maxsize=64)
def _flat_pair_index(num_features, self_interaction):
    """Flat indices into a (F*F,) row of Z for the forward gather and the backward scatter.

    -> (lower (P,): r*F + c of each pair; upper (Q,): c*F + r of the off-diagonal pairs;
        offdiag (Q,) positions of those pairs among the P, or None when all P are off-diagonal)
    """
    f = num_features
    rows, cols = interaction_pairs(f, self_interaction)
    off = rows != cols
    lower = rows * f + cols
    upper = (cols * f + rows)[off]
    return lower, upper, (None if off.all() else np.flatnonzero(off))


def _gram(x):
    # (B, F, D) @ (B, D, F): numpy's stacked matmul calls BLAS per sample
    return np.matmul(x, x.transpose(0, 2, 1))


def dot_interaction_forward(x, concat, self_interaction, pad):
    """Pairwise dot products of the features of each sample.

    x: (B, F, D); concat: (B, C) or None; self_interaction: bool; pad: int >= 0
    -> out (B, C + P + pad) with P = F(F-1)/2 (F(F+1)/2 with self_interaction):
       ``[concat | Z[r, c] for the pairs of interaction_pairs | pad zeros]``, Z = x xᵀ per sample.
    """
    b, f, _ = x.shape
    lower, _, _ = _flat_pair_index(f, bool(self_interaction))
    c = 0 if concat is None else concat.shape[1]
    p = lower.shape[0]
    out = np.empty((b, c + p + pad), dtype=x.dtype)
    if c:
        out[:, :c] = concat
    # mode="clip" lets take write straight into the strided slice (indices are in range)
    np.take(_gram(x).reshape(b, f * f), lower, axis=1, out=out[:, c:c + p], mode="clip")
    if pad:
        out[:, c + p:] = 0
    return out


def dot_interaction_backward(dout, x, n_concat, self_interaction):
    """dout: (B, C + P + pad); x: (B, F, D); n_concat: C
    -> (dx (B, F, D), dconcat (B, C) or None); dx = (dZ + dZᵀ) x, padding gets no gradient.
    """
    b, f, _ = x.shape
    lower, upper, offdiag = _flat_pair_index(f, bool(self_interaction))
    p = lower.shape[0]
    dpairs = dout[:, n_concat:n_concat + p]
    # dZ + dZᵀ written directly: off-diagonal pairs land on two distinct cells, so plain
    # assignments suffice (a fancy-indexed += is several times slower); a diagonal pair
    # (self_interaction) gets 2 * dZ[r, r]
    dsym = np.zeros((b, f * f), dtype=dout.dtype)
    dsym[:, lower] = dpairs
    if offdiag is None:
        dsym[:, upper] = dpairs
    else:
        dsym[:, upper] = dpairs[:, offdiag]
        diag = np.arange(f) * (f + 1)
        dsym[:, diag] *= 2
    dx = np.matmul(dsym.reshape(b, f, f), x)
    dconcat = np.ascontiguousarray(dout[:, :n_concat]) if n_concat else None
    return dx, dconcat


# ---------------------------------------------------------------- DCN cross layers


def cross_vector_forward(x0, xl, w, b):
    """DCN v1 layer. x0, xl: (B, D); w, b: (D,) -> x_next (B, D) = x0 * (xl · w)[:, None] + b + xl."""
    s = xl @ w
    out = x0 * s[:, None]
    out += b
    out += xl
    return out


def cross_vector_backward(dnext, x0, xl, w):
    """dnext: (B, D) -> (dx0 (B, D), dxl (B, D), dw (D,), db (D,))."""
    s = xl @ w                                   # (B,)
    ds = np.einsum("bd,bd->b", dnext, x0)        # (B,)
    dx0 = dnext * s[:, None]
    dxl = np.multiply.outer(ds, w)
    dxl += dnext
    return dx0, dxl, ds @ xl, dnext.sum(axis=0)


def cross_matrix_forward(x0, xl, W, b):
    """DCN v2 layer. x0, xl: (B, D); W: (D, D); b: (D,) -> x_next (B, D) = (xl Wᵀ + b) * x0 + xl."""
    h = xl @ W.T
    h += b
    h *= x0
    h += xl
    return h


def cross_matrix_backward(dnext, x0, xl, W, b):
    """dnext: (B, D) -> (dx0 (B, D), dxl (B, D), dW (D, D), db (D,)); h = xl Wᵀ + b is recomputed."""
    h = xl @ W.T
    h += b
    dx0 = h
    dx0 *= dnext                                 # dx0 = dnext * h
    dh = dnext * x0
    dxl = dh @ W
    dxl += dnext
    return dx0, dxl, dh.T @ xl, dh.sum(axis=0)


# ---------------------------------------------------------------- factorization machine


def fm_forward(x):
    """Second-order FM term summed over the dimension: x (B, F, D) -> (B,).

    out[b] = sum_d 0.5 * ((sum_f x[b, f, d])^2 - sum_f x[b, f, d]^2)
    """
    s = x.sum(axis=1)                            # (B, D)
    sq = np.einsum("bfd,bfd->b", x, x)
    return 0.5 * (np.einsum("bd,bd->b", s, s) - sq)


def fm_backward(dout, x):
    """dout: (B,); x: (B, F, D) -> dx (B, F, D) = dout * (sum_f x - x)."""
    s = x.sum(axis=1, keepdims=True)             # (B, 1, D)
    dx = s - x
    dx *= dout[:, None, None]
    return dx


# ---------------------------------------------------------------- loss


def bce_with_logits_forward(logits, labels):
    """Mean binary cross-entropy of ``logits`` (B,) against ``labels`` (B,) in [0, 1] -> float.

    Stable form: max(z, 0) - z * y + log1p(exp(-|z|)).
    """
    z = logits
    per = np.maximum(z, 0) - z * labels + np.log1p(np.exp(-np.abs(z)))
    return float(per.mean(dtype=np.float64))


def bce_with_logits_backward(logits, labels):
    """-> dlogits (B,) = (sigmoid(logits) - labels) / B, in the logits' dtype."""
    z = logits
    # sigmoid without overflow for large |z|
    e = np.exp(-np.abs(z))
    sig = np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(z.dtype, copy=False)
    return ((sig - labels) / z.shape[0]).astype(z.dtype, copy=False)


# ---------------------------------------------------------------- embedding rows
# The numpy twins of the embedding side's device ops (device_ops) that have no CPU implementation
# elsewhere; unique + inverse, segment sums, initial values, optimizer updates and codecs are
# twinned by parallel.unique, initializers, optim.kernels and parallel.codec.


def gather_rows(src, index):
    """src: (R, E), index: (...) int64 -> (..., E) ``src[index]``, zero rows where index < 0.

    The embedding shuffle's gather by inverse; a negative index marks a padding position.
    """
    index = np.asarray(index, dtype=np.int64)
    out = np.zeros(index.shape + (src.shape[1],), src.dtype)
    valid = index >= 0
    out[valid] = src[index[valid]]
    return out
