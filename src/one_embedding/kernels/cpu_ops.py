"""Compiled CPU kernels (numba) for the hot fused ops of the dense layers; ``reference`` is their spec.

The layers call these on numpy arrays where they pay off: the bias + activation passes of every
Linear and the dot interaction, which numpy runs as several passes over (B, N) temporaries or as
per-sample BLAS calls. Each function returns what its namesake in ``reference`` returns, within
float rounding (tests/unit/test_kernels_cpu.py), with two documented differences:

- the ReLU "mask" of ``bias_act_forward`` is the output ``y`` itself (y > 0 is the mask), so no
  (B, N) bool array is written; like every mask it is opaque and consumed only by
  ``bias_act_backward`` here, and the caller must not overwrite ``y`` before the backward;
- the dot interaction also takes its features as a list of one or two (B, F_i, D) arrays, read in
  place as if stacked along F (DLRM's [bottom output, embeddings] need no (B, F, D) concatenation),
  and its backward then returns the feature gradient as a list of the same shapes.

Every kernel releases the GIL (``nogil``) and runs on the calling thread only, leaving the
other core to the prefetch thread. Measured on the 2-core machine (DLRM, B = 4096, 27 x 64): the
interaction on numba's thread pool (``parallel``) took 6 + 13 ms alone against 8 + 17 ms on one
thread, but inside the training step it lost: right after a matmul OpenBLAS's worker still spins
on the second core, and numba's OpenMP workers spin after their loop and slow the next matmul
(416 -> 512 forward: 21 ms against 14); the whole dense step took a median 194 ms with two
threads against 176 ms with one. A helper thread pulling chunks of samples gained nothing in the
step either (interaction 40.6 ms against 39.8): after each matmul OpenBLAS's idle worker keeps
the second core busy for up to ~0.1 s (OPENBLAS_THREAD_TIMEOUT, read at numpy's import; with it
at 4 the helper cut the interaction to 26 ms, but the whole step was no faster: 196 ms against
191).

Dot products are summed with ``fastmath={"reassoc", "contract"}`` only: that lets the D-long sums
vectorise (about 10x here) and keeps NaN and infinity semantics; results then differ from
numpy's order by ~1e-7 relative.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import reference


#: flags of the dot-product kernels: reassociate sums (vectorise) and fuse multiply-adds, nothing else
_SUM_FLAGS = {"reassoc", "contract"}

#: dtypes the kernels are compiled for; others (float16, integers) run the numpy reference
_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))



# ---------------------------------------------------------------- bias + activation


@njit(cache=True, nogil=True)
def _bias_relu(h, b, relu):  # pragma: no cover - compiled
    n, m = h.shape
    for i in range(n):
        for j in range(m):
            v = h[i, j] + b[j]
            # v < 0 is False for NaN and -0.0: both pass through, as np.maximum(v, 0) keeps NaN
            if relu and v < 0:
                v = 0
            h[i, j] = v


@njit(cache=True, nogil=True)
def _relu_grad_colsum(dy, y, dh, db):  # pragma: no cover - compiled
    # dh = dy * (y > 0) and db = Σ_rows dh in one pass; rows in order, as numpy's axis-0 sum adds them
    n, m = dy.shape
    db[:] = 0
    for i in range(n):
        for j in range(m):
            g = dy[i, j] if y[i, j] > 0 else dy[i, j] * 0  # dy * 0, not 0: NaN stays NaN as in dy * mask
            dh[i, j] = g
            db[j] += g


@njit(cache=True, nogil=True)
def _colsum(dy, db):  # pragma: no cover - compiled
    n, m = dy.shape
    db[:] = 0
    for i in range(n):
        for j in range(m):
            db[j] += dy[i, j]


def bias_act_forward(h, b, relu):
    """``y = relu(h + b)`` (or ``h + b``) in one pass, in place in ``h``.

    h: (B, N) float32/float64, C-contiguous, overwritten; b: (N,) same dtype; relu: bool
    -> (y (B, N) (= h), mask): mask is y itself with relu (y > 0 marks the kept entries), else None.
    """
    _bias_relu(h, b, bool(relu))
    return h, (h if relu else None)


def bias_act_backward(dy, mask):
    """dy: (B, N); mask from ``bias_act_forward`` (y or None) -> (dh (B, N), db (N,)).

    dh = dy * (y > 0) (dy itself without relu), db = Σ_rows dh; one pass, no (B, N) temporaries.
    """
    db = np.empty(dy.shape[1], dtype=dy.dtype)
    if mask is None:
        _colsum(dy, db)
        return dy, db
    dh = np.empty(dy.shape, dtype=dy.dtype)
    _relu_grad_colsum(dy, mask, dh, db)
    return dh, db


# ---------------------------------------------------------------- dot interaction


@njit(cache=True, nogil=True)
def _load_features(x1, x2, b, xs):  # pragma: no cover - compiled
    # sample b's F = F1 + F2 feature rows, contiguous in xs (F, D), so the loops below read one array
    f1 = x1.shape[1]
    for r in range(f1):
        xs[r, :] = x1[b, r, :]
    for r in range(x2.shape[1]):
        xs[f1 + r, :] = x2[b, r, :]


@njit(cache=True, nogil=True, fastmath=_SUM_FLAGS)
def _interaction_forward(x1, x2, concat, self_interaction, out):  # pragma: no cover - compiled
    batch, f1, d = x1.shape
    f = f1 + x2.shape[1]
    c = concat.shape[1]
    width = out.shape[1]
    xs = np.empty((f, d), dtype=x1.dtype)
    zero = np.zeros(1, dtype=x1.dtype)[0]  # a sum's start, typed like x (0.0 would widen to float64)
    for b in range(batch):
        _load_features(x1, x2, b, xs)
        for j in range(c):
            out[b, j] = concat[b, j]
        k = c
        for r in range(f):
            n = r + 1 if self_interaction else r
            q = 0
            # Z[r, q..q+3] together: each xs[r, e] load feeds four sums
            while q + 4 <= n:
                s0 = s1 = s2 = s3 = zero
                for e in range(d):
                    v = xs[r, e]
                    s0 += v * xs[q, e]
                    s1 += v * xs[q + 1, e]
                    s2 += v * xs[q + 2, e]
                    s3 += v * xs[q + 3, e]
                out[b, k] = s0
                out[b, k + 1] = s1
                out[b, k + 2] = s2
                out[b, k + 3] = s3
                k += 4
                q += 4
            while q < n:
                s0 = zero
                for e in range(d):
                    s0 += xs[r, e] * xs[q, e]
                out[b, k] = s0
                k += 1
                q += 1
        for j in range(k, width):
            out[b, j] = 0


@njit(cache=True, nogil=True, fastmath=_SUM_FLAGS)
def _interaction_backward(dout, x1, x2, self_interaction, dx1, dx2, dconcat):  # pragma: no cover - compiled
    batch, f1, d = x1.shape
    f = f1 + x2.shape[1]
    c = dconcat.shape[1]
    xs = np.empty((f, d), dtype=x1.dtype)
    g = np.empty((f, f), dtype=x1.dtype)
    acc = np.empty(d, dtype=x1.dtype)
    for b in range(batch):
        _load_features(x1, x2, b, xs)
        for j in range(c):
            dconcat[b, j] = dout[b, j]
        # G = dZ + dZᵀ: an off-diagonal pair lands on two cells, a diagonal one counts twice
        g[:, :] = 0
        k = c
        for r in range(f):
            for q in range(r + 1 if self_interaction else r):
                v = dout[b, k]
                g[r, q] += v
                g[q, r] += v
                k += 1
        # dX = G X, row by row; four rows of X per pass over acc halve its loads and stores
        for i in range(f):
            acc[:] = 0
            j = 0
            while j + 4 <= f:
                g0, g1, g2, g3 = g[i, j], g[i, j + 1], g[i, j + 2], g[i, j + 3]
                for e in range(d):
                    acc[e] += g0 * xs[j, e] + g1 * xs[j + 1, e] + g2 * xs[j + 2, e] + g3 * xs[j + 3, e]
                j += 4
            while j < f:
                g0 = g[i, j]
                for e in range(d):
                    acc[e] += g0 * xs[j, e]
                j += 1
            if i < f1:
                dx1[b, i, :] = acc
            else:
                dx2[b, i - f1, :] = acc


def _feature_parts(x):
    """x: (B, F, D) or a list of (B, F_i, D) arrays -> (x1, x2, pair): C-contiguous, one dtype.

    pair: x is a list of two arrays read in place as x1, x2. Otherwise x1 holds every feature
    (a list of one, or of more than two, is concatenated) and x2 is empty (B, 0, D).
    """
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    pair = len(parts) == 2 and parts[0].dtype == parts[1].dtype
    if not pair:
        parts = [parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)]
        b, _, d = parts[0].shape
        parts.append(np.empty((b, 0, d), dtype=parts[0].dtype))
    return np.ascontiguousarray(parts[0]), np.ascontiguousarray(parts[1]), pair


def dot_interaction_forward(x, concat, self_interaction, pad):
    """Pairwise dot products of the features of each sample, fused into one pass per sample.

    x: (B, F, D) or a list of one or two (B, F_i, D) arrays (stacked along F, not copied);
    concat: (B, C) or None; self_interaction: bool; pad: int >= 0
    -> out (B, C + P + pad) = ``[concat | Z[r, c] for the pairs of interaction_pairs | zeros]``.
    """
    x1, x2, _ = _feature_parts(x)
    if x1.dtype not in _COMPILED:
        return reference.dot_interaction_forward(_stacked(x1, x2), concat, self_interaction, pad)
    b, f = x1.shape[0], x1.shape[1] + x2.shape[1]
    if concat is None:
        concat = np.empty((b, 0), dtype=x1.dtype)
    pairs = f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2
    out = np.empty((b, concat.shape[1] + pairs + int(pad)), dtype=x1.dtype)
    _interaction_forward(x1, x2, concat, bool(self_interaction), out)
    return out


def dot_interaction_backward(dout, x, n_concat, self_interaction):
    """dout: (B, C + P + pad); x: what the forward took; n_concat: C
    -> (dx, dconcat (B, C) or None); dx = (dZ + dZᵀ) X, (B, F, D) or a list shaped like x.
    """
    x1, x2, pair = _feature_parts(x)
    dout = np.ascontiguousarray(dout)
    if x1.dtype not in _COMPILED or dout.dtype != x1.dtype:
        dx, dconcat = reference.dot_interaction_backward(dout, _stacked(x1, x2), n_concat, self_interaction)
        dx1, dx2 = dx[:, :x1.shape[1]], dx[:, x1.shape[1]:]
    else:
        dx1, dx2 = np.empty_like(x1), np.empty_like(x2)
        dconcat = np.empty((dout.shape[0], int(n_concat)), dtype=dout.dtype)
        _interaction_backward(dout, x1, x2, bool(self_interaction), dx1, dx2, dconcat)
        dconcat = dconcat if n_concat else None
    if pair:
        dx = [dx1, dx2]
    elif isinstance(x, (list, tuple)):
        bounds = np.cumsum([0] + [p.shape[1] for p in x])
        dx = [dx1[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    else:
        dx = dx1
    return dx, dconcat


def _stacked(x1, x2):
    return x1 if x2.shape[1] == 0 else np.concatenate([x1, x2], axis=1)
