"""Fused operators on CuPy arrays: the CUDA twins of ``reference`` (same names and signatures).

Each function validates its inputs (``InputError`` naming the value and the fix), then launches
the kernels of ``cuda/<family>.cu`` through ``cuda_module``. Arrays are C-contiguous float32, or
float64 for finite-difference gradient checks; outputs keep the input dtype. GEMMs (the batched
X Xᵀ of the dot interaction, the DCN v2 matmuls) run in cuBLAS through ``gemm.matmul``; the
kernels fuse the elementwise work and reductions around them. Column reductions write per-chunk
partial sums that are then summed in a fixed order, so every result is deterministic run to run.

Masks are bit-packed: uint32 words (ceil(B * N / 32),), element i of the flat (B, N) array is
bit i % 32 of word i // 32 (``numpy.packbits(..., bitorder="little")`` viewed as uint32), one
eighth of the memory of a bool mask. They are opaque to callers: a forward here makes them and
only the backward here reads them. ``unpack_mask`` turns one into a bool array for inspection.

``import cupy`` happens inside the functions only: importing this module does not need a GPU.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from . import cuda_module as cm

_FLOAT_DTYPES = tuple(cm.CTYPES)


def _cupy():
    import cupy

    return cupy


def _float_array(name, a, ndim, like=None):
    """``a`` as a C-contiguous cupy array of ``ndim`` dims and float32/float64 (``like``'s) dtype."""
    cp = _cupy()
    if not isinstance(a, cp.ndarray):
        raise InputError(
            f"{name} is a {type(a).__module__}.{type(a).__name__}, not a cupy array: "
            "move it to the GPU with cupy.asarray, or use the numpy reference kernels")
    if a.ndim != ndim:
        raise InputError(f"{name} has shape {tuple(a.shape)} but must have {ndim} dimensions")
    if like is None:
        if a.dtype not in _FLOAT_DTYPES:
            raise InputError(f"{name}.dtype={a.dtype}: use float32 (or float64 for gradient checks)")
    elif a.dtype != like.dtype:
        raise InputError(f"{name}.dtype={a.dtype} differs from {like.dtype}: cast it with .astype")
    if a.device.id != cp.cuda.Device().id:
        raise InputError(
            f"{name} lives on device {a.device.id} but device {cp.cuda.Device().id} is current: "
            "run inside `with cupy.cuda.Device(...)` of the arrays' device")
    return cp.ascontiguousarray(a)


def _expect_shape(name, a, shape):
    if tuple(a.shape) != tuple(shape):
        raise InputError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _check_mask(name, mask, n):
    cp = _cupy()
    words = cm.mask_words(n)
    if not isinstance(mask, cp.ndarray) or mask.dtype != np.uint32 or mask.shape != (words,):
        shape = getattr(mask, "shape", None)
        raise InputError(
            f"{name} (type {type(mask).__name__}, shape {shape}) is not a bit-packed CUDA mask of "
            f"{words} uint32 words: pass the mask returned by the cuda_ops forward of this output")
    return mask


def _check_rate(rate):
    if not 0.0 <= float(rate) < 1.0:
        raise InputError(f"dropout rate={rate!r} must lie in [0, 1)")


def _matmul(a, b):
    """``a @ b`` of float32 cupy arrays through ``gemm.matmul`` (cuBLAS's fp32 product; a CUDA
    graph can capture it, where CuPy refuses its own matmul); float64 ones through cupy.matmul."""
    if a.dtype == np.float32 and b.dtype == np.float32:
        from .gemm import matmul

        return matmul(a, b, "fp32")
    return _cupy().matmul(a, b)


def _launch_1d(family, name, dtype, n_threads, args):
    blocks = cm.grid_stride_blocks(n_threads, cm.sm_count())
    cm.get_kernel(family, name, dtype)((blocks,), (cm.BLOCK,), args)


def _launch_warps(family, name, dtype, n_warp_items, args):
    blocks = cm.warp_blocks(n_warp_items, cm.sm_count())
    cm.get_kernel(family, name, dtype)((blocks,), (cm.BLOCK,), args)


def _column_grid(rows, cols):
    """(grid, block, n_chunks, rows_per_chunk) of a column-reduction kernel."""
    n_chunks, rows_per_chunk = cm.column_chunks(rows, cols, cm.sm_count())
    grid = (max(1, -(-cols // 32)), n_chunks)
    return grid, (32, cm.COLUMN_BLOCK_ROWS), n_chunks, rows_per_chunk


def unpack_mask(mask, shape):
    """A bit-packed mask (words,) uint32 -> bool cupy array of ``shape`` (for tests and debugging)."""
    cp = _cupy()
    n = int(np.prod(shape))
    _check_mask("mask", mask, n)
    bits = (mask[:, None] >> cp.arange(32, dtype=cp.uint32)[None, :]) & cp.uint32(1)
    return bits.reshape(-1)[:n].astype(cp.bool_).reshape(shape)


# ---------------------------------------------------------------- bias + activation


def bias_act_forward(h, b, relu):
    """``y = relu(h + b)`` (or ``h + b``), computed in place in ``h``.

    h: (B, N) float matmul output (overwritten); b: (N,) same dtype; relu: bool
    -> (y (B, N), mask (ceil(B * N / 32),) uint32 bit-packed y > 0, or None when not relu)
    """
    cp = _cupy()
    h = _float_array("h", h, 2)
    b = _float_array("b", b, 1, like=h)
    rows, cols = h.shape
    _expect_shape("b", b, (cols,))
    words = cm.mask_words(rows * cols)
    mask = cp.empty((words,), dtype=cp.uint32) if relu else None
    if words:
        # without relu the mask pointer is never dereferenced: an empty uint32 array of the
        # kernel's own type stands in for it (the emulator checks every argument's type)
        _launch_warps("mlp", "bias_act_forward", h.dtype, words,
                      (h, b, np.int64(rows), np.int32(cols), np.int32(bool(relu)), h,
                       mask if relu else _no_mask(cp), np.int32(cm.LOADS_AHEAD)))
    return h, mask


def _no_mask(cp):
    """The ``unsigned* relu_mask`` argument of a launch without ReLU (never read)."""
    return cp.empty((0,), dtype=cp.uint32)


def bias_act_backward(dy, mask):
    """dy: (B, N); mask from ``bias_act_forward`` (or None) -> (dh (B, N), db (N,)); dh = dy * mask."""
    cp = _cupy()
    dy = _float_array("dy", dy, 2)
    rows, cols = dy.shape
    if mask is not None:
        _check_mask("mask", mask, rows * cols)
    grid, block, n_chunks, rows_per_chunk = _column_grid(rows, cols)
    dh = cp.empty_like(dy)
    partial = cp.empty((n_chunks, cols), dtype=dy.dtype)
    if cols:
        cm.get_kernel("mlp", "bias_act_backward", dy.dtype)(
            grid, block,
            (dy, _no_mask(cp) if mask is None else mask, np.int32(mask is not None), np.int64(rows),
             np.int32(cols), np.int64(rows_per_chunk), dh, partial, np.int32(cm.LOADS_AHEAD)))
    return dh, partial.sum(axis=0)


# ---------------------------------------------------------------- dropout


def _dropout_scale(rate, dtype):
    # the reference's scale: the float64 reciprocal rounded once to the working dtype
    return np.dtype(dtype).type(1.0 / (1.0 - float(rate)))


def dropout_forward(x, rate, seed, step):
    """x: (B, N) -> (y (B, N), keep_mask (ceil(B * N / 32),) uint32 bit-packed).

    keep[i] = uniform01(counter_hash(seed, key=step, column=i, stream=0)) > rate over the flat
    index i, bit-identical to the reference; y = x * keep * (1 / (1 - rate)).
    """
    cp = _cupy()
    x = _float_array("x", x, 2)
    _check_rate(rate)
    n = x.size
    words = cm.mask_words(n)
    y = cp.empty_like(x)
    keep = cp.empty((words,), dtype=cp.uint32)
    if words:
        # uint64 wrap-around, as counter_hash's astype(uint64) does for negative values
        seed64 = np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)
        step64 = np.uint64(int(step) & 0xFFFFFFFFFFFFFFFF)
        _launch_warps("mlp", "dropout_forward", x.dtype, words,
                      (x, np.int64(n), np.float64(rate), _dropout_scale(rate, x.dtype),
                       seed64, step64, y, keep))
    return y, keep


def dropout_backward(dy, keep_mask, rate):
    """dy: (B, N), keep_mask from ``dropout_forward`` -> dx (B, N) = dy * keep / (1 - rate)."""
    cp = _cupy()
    dy = _float_array("dy", dy, 2)
    _check_rate(rate)
    _check_mask("keep_mask", keep_mask, dy.size)
    dx = cp.empty_like(dy)
    if dy.size:
        _launch_1d("mlp", "dropout_backward", dy.dtype, dy.size,
                   (dy, keep_mask, np.int64(dy.size), _dropout_scale(rate, dy.dtype), dx))
    return dx


# ---------------------------------------------------------------- dot interaction


def _n_pairs(f, self_interaction):
    return f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2


def dot_interaction_forward(x, concat, self_interaction, pad):
    """Pairwise dot products of the features of each sample.

    x: (B, F, D); concat: (B, C) or None; self_interaction: bool; pad: int >= 0
    -> out (B, C + P + pad) with P = F(F-1)/2 (F(F+1)/2 with self_interaction):
       ``[concat | Z[r, c] for the pairs of cuda_module.pair_table | pad zeros]``, Z = x xᵀ.
    Z comes from a batched cuBLAS GEMM (gemm.matmul); one kernel gathers the triangle and writes
    concat and padding.
    """
    cp = _cupy()
    x = _float_array("x", x, 3)
    batch, f, _ = x.shape
    if int(pad) != pad or pad < 0:
        raise InputError(f"pad={pad!r} must be an integer >= 0")
    pad = int(pad)
    n_concat = 0
    if concat is not None:
        concat = _float_array("concat", concat, 2, like=x)
        if concat.shape[0] != batch:
            raise InputError(f"concat has {concat.shape[0]} rows but x has batch {batch}")
        n_concat = concat.shape[1]
    n_pairs = _n_pairs(f, bool(self_interaction))
    width = n_concat + n_pairs + pad
    out = cp.empty((batch, width), dtype=x.dtype)
    if out.size:
        z = _matmul(x, x.transpose(0, 2, 1))                        # (B, F, F)
        pairs = cm.device_pair_table(f, bool(self_interaction))
        _launch_1d("interaction", "gather_forward", x.dtype, out.size,
                   (z, x if concat is None else concat, pairs, np.int64(batch), np.int32(f),
                    np.int32(n_concat), np.int32(n_pairs), np.int32(width), out))
    return out


def dot_interaction_backward(dout, x, n_concat, self_interaction):
    """dout: (B, C + P + pad); x: (B, F, D); n_concat: C
    -> (dx (B, F, D), dconcat (B, C) or None when C == 0); dx = (dZ + dZᵀ) x, padding gets no gradient.
    """
    cp = _cupy()
    dout = _float_array("dout", dout, 2)
    x = _float_array("x", x, 3, like=dout)
    batch, f, _ = x.shape
    n_concat = int(n_concat)
    n_pairs = _n_pairs(f, bool(self_interaction))
    width = dout.shape[1]
    if dout.shape[0] != batch:
        raise InputError(f"dout has {dout.shape[0]} rows but x has batch {batch}")
    if n_concat < 0 or width < n_concat + n_pairs:
        raise InputError(
            f"dout has {width} columns, fewer than n_concat={n_concat} + {n_pairs} pairs of "
            f"{f} features (self_interaction={bool(self_interaction)}): check n_concat")
    dsym = cp.zeros((batch, f, f), dtype=x.dtype)
    dconcat = cp.empty((batch, n_concat), dtype=x.dtype) if n_concat else None
    if batch and n_concat + n_pairs:
        pairs = cm.device_pair_table(f, bool(self_interaction))
        _launch_1d("interaction", "scatter_backward", x.dtype, batch * (n_concat + n_pairs),
                   (dout, pairs, np.int64(batch), np.int32(f), np.int32(n_concat),
                    np.int32(n_pairs), np.int32(width), dsym, dsym if dconcat is None else dconcat))
    dx = _matmul(dsym, x)                                           # (B, F, D)
    return dx, dconcat


# ---------------------------------------------------------------- DCN cross layers


def _cross_inputs(x0, xl):
    x0 = _float_array("x0", x0, 2)
    xl = _float_array("xl", xl, 2, like=x0)
    _expect_shape("xl", xl, x0.shape)
    return x0, xl


def cross_vector_forward(x0, xl, w, b):
    """DCN v1 layer. x0, xl: (B, D); w, b: (D,) -> x_next (B, D) = x0 * (xl · w)[:, None] + b + xl."""
    cp = _cupy()
    x0, xl = _cross_inputs(x0, xl)
    rows, dim = x0.shape
    w = _float_array("w", w, 1, like=x0)
    b = _float_array("b", b, 1, like=x0)
    _expect_shape("w", w, (dim,))
    _expect_shape("b", b, (dim,))
    out = cp.empty_like(x0)
    if out.size:
        _launch_warps("cross", "vector_forward", x0.dtype, rows,
                      (x0, xl, w, b, np.int64(rows), np.int32(dim), out))
    return out


def cross_vector_backward(dnext, x0, xl, w):
    """dnext: (B, D) -> (dx0 (B, D), dxl (B, D), dw (D,), db (D,))."""
    cp = _cupy()
    x0, xl = _cross_inputs(x0, xl)
    rows, dim = x0.shape
    dnext = _float_array("dnext", dnext, 2, like=x0)
    _expect_shape("dnext", dnext, x0.shape)
    w = _float_array("w", w, 1, like=x0)
    _expect_shape("w", w, (dim,))
    dx0 = cp.empty_like(x0)
    dxl = cp.empty_like(x0)
    ds = cp.empty((rows,), dtype=x0.dtype)
    grid, block, n_chunks, rows_per_chunk = _column_grid(rows, dim)
    dw_partial = cp.empty((n_chunks, dim), dtype=x0.dtype)
    db_partial = cp.empty((n_chunks, dim), dtype=x0.dtype)
    if dim:
        if rows:
            _launch_warps("cross", "vector_backward_rows", x0.dtype, rows,
                          (dnext, x0, xl, w, np.int64(rows), np.int32(dim), dx0, dxl, ds))
        cm.get_kernel("cross", "vector_backward_params", x0.dtype)(
            grid, block,
            (dnext, xl, ds, np.int64(rows), np.int32(dim), np.int64(rows_per_chunk),
             dw_partial, db_partial))
    return dx0, dxl, dw_partial.sum(axis=0), db_partial.sum(axis=0)


def _matrix_params(W, b, like):
    dim = like.shape[1]
    W = _float_array("W", W, 2, like=like)
    b = _float_array("b", b, 1, like=like)
    _expect_shape("W", W, (dim, dim))
    _expect_shape("b", b, (dim,))
    return W, b


def cross_matrix_forward(x0, xl, W, b):
    """DCN v2 layer. x0, xl: (B, D); W: (D, D); b: (D,) -> x_next (B, D) = (xl Wᵀ + b) * x0 + xl."""
    cp = _cupy()
    x0, xl = _cross_inputs(x0, xl)
    W, b = _matrix_params(W, b, x0)
    rows, dim = x0.shape
    t = _matmul(xl, W.T)                                            # (B, D)
    if t.size:
        # the epilogue writes its result over t: one (B, D) buffer for the whole layer
        _launch_1d("cross", "matrix_forward_epilogue", x0.dtype, t.size,
                   (t, b, x0, xl, np.int64(rows), np.int32(dim), t))
    return t


def cross_matrix_backward(dnext, x0, xl, W, b):
    """dnext: (B, D) -> (dx0 (B, D), dxl (B, D), dW (D, D), db (D,)); t = xl Wᵀ is recomputed.

    dx0 = dnext * (t + b); du = dnext * x0; db = sum_B du; dW = duᵀ xl; dxl = du W + dnext.
    """
    cp = _cupy()
    x0, xl = _cross_inputs(x0, xl)
    W, b = _matrix_params(W, b, x0)
    dnext = _float_array("dnext", dnext, 2, like=x0)
    _expect_shape("dnext", dnext, x0.shape)
    rows, dim = x0.shape
    t = _matmul(xl, W.T)                                            # (B, D)
    du = cp.empty_like(x0)
    grid, block, n_chunks, rows_per_chunk = _column_grid(rows, dim)
    db_partial = cp.empty((n_chunks, dim), dtype=x0.dtype)
    if dim:
        # dx0 is written over t (each element reads its own t first)
        cm.get_kernel("cross", "matrix_backward_elementwise", x0.dtype)(
            grid, block,
            (dnext, x0, t, b, np.int64(rows), np.int32(dim), np.int64(rows_per_chunk), t, du,
             db_partial))
    dx0 = t
    dxl = _matmul(du, W)                                            # (B, D)
    dxl += dnext
    dW = _matmul(du.T, xl)                                          # (D, D)
    return dx0, dxl, dW, db_partial.sum(axis=0)


# ---------------------------------------------------------------- factorization machine


def fm_forward(x):
    """Second-order FM term summed over the dimension: x (B, F, D) -> (B,).

    out[b] = sum_d 0.5 * ((sum_f x[b, f, d])^2 - sum_f x[b, f, d]^2); one warp per sample.
    """
    cp = _cupy()
    x = _float_array("x", x, 3)
    batch, f, dim = x.shape
    out = cp.empty((batch,), dtype=x.dtype)
    if batch:
        _launch_warps("fm", "forward", x.dtype, batch,
                      (x, np.int64(batch), np.int32(f), np.int32(dim), out))
    return out


def fm_backward(dout, x):
    """dout: (B,); x: (B, F, D) -> dx (B, F, D) = dout * (sum_f x - x)."""
    cp = _cupy()
    x = _float_array("x", x, 3)
    dout = _float_array("dout", dout, 1, like=x)
    _expect_shape("dout", dout, x.shape[:1])
    batch, f, dim = x.shape
    dx = cp.empty_like(x)
    if dx.size:
        _launch_warps("fm", "backward", x.dtype, batch,
                      (dout, x, np.int64(batch), np.int32(f), np.int32(dim), dx))
    return dx


# ---------------------------------------------------------------- loss


def _bce_inputs(logits, labels):
    cp = _cupy()
    logits = _float_array("logits", logits, 1)
    if not isinstance(labels, cp.ndarray):
        raise InputError(f"labels is a {type(labels).__name__}, not a cupy array: use cupy.asarray")
    _expect_shape("labels", labels, logits.shape)
    if logits.shape[0] == 0:
        raise InputError("logits is empty: the mean loss of an empty batch is undefined")
    # labels may come as int or float of another width; the math runs in the logits' dtype
    labels = cp.ascontiguousarray(labels, dtype=logits.dtype)
    return logits, labels


def bce_with_logits_forward(logits, labels):
    """Mean binary cross-entropy of ``logits`` (B,) against ``labels`` (B,) in [0, 1] -> a 0-d
    float64 device array (left on the device: the trainer reads its losses every
    ``--log-interval`` steps; ``float()`` of it waits for the device).

    Stable form max(z, 0) - z * y + log1p(exp(-|z|)), summed in float64.
    """
    cp = _cupy()
    logits, labels = _bce_inputs(logits, labels)
    n = logits.shape[0]
    blocks = cm.grid_stride_blocks(n, cm.sm_count())
    block_sums = cp.empty((blocks,), dtype=cp.float64)
    cm.get_kernel("loss", "bce_forward", logits.dtype)(
        (blocks,), (cm.BLOCK,), (logits, labels, np.int64(n), block_sums))
    return block_sums.sum() / n


def bce_with_logits_backward(logits, labels):
    """-> dlogits (B,) = (sigmoid(logits) - labels) / B, in the logits' dtype."""
    cp = _cupy()
    logits, labels = _bce_inputs(logits, labels)
    n = logits.shape[0]
    dlogits = cp.empty_like(logits)
    _launch_1d("loss", "bce_backward", logits.dtype, n, (logits, labels, np.int64(n), dlogits))
    return dlogits
