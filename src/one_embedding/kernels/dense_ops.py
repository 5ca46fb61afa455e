"""The AMP path's fused dense kernels (``kernels/cuda/dense.cu``) on device arrays, and their
float64 numpy references (the ``*_reference`` functions: the spec the kernels are tested against).

Every launching function takes ``launch``, a ``device_ops.Launcher`` (None: the CuPy launcher of
the current device), so the same glue runs the kernels on a GPU and, in the tests, on numpy arrays
through the host emulator (``tests/cuda_emulation.py``).

``precision`` is one of ``nn.amp.PRECISIONS``: products take operands rounded to it and
accumulate in the arrays' float type; under fp16 / bf16 the interaction's dot products and its
input gradient leave rounded to the half type (nn.amp's contract; tf32 results stay fp32).

- ``bias_act_cast_forward``: y = relu(h + b), its bit-packed mask, and the 16-bit copy of y
  that the next layer's GEMM reads: the GEMM's epilogue as one pass. ``bias_act_backward_cast``:
  its backward, dh = dy * mask written only as the 16-bit pattern both backward GEMMs read, and
  the bias gradient.
- ``interaction_forward`` / ``interaction_backward``: the DLRM dot interaction, one kernel each
  way, reading the features as two parts in place ([bottom (B, F1, D), embeddings (B, F2, D)]):
  no concatenation, no batched GEMM, no (B, F, F) buffer. The ``_packed`` pair reads one
  (B, F, D) buffer instead, float32 or the fp16 / bf16 patterns the embedding's gather wrote
  (``kernels.layout_ops``).
- ``bce_last_layer``: the mean BCE loss fused with the backward of the one-output last layer:
  the logit gradient, the input gradient (an outer product), the weight and bias gradients.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from . import cuda_module as cm
from .device_ops import resolve
from .gemm import KINDS
from .precision import HALF_PRECISIONS, check_precision, round_to


def _kind(precision: str) -> int:
    check_precision(precision)
    return 0 if precision == "off" else KINDS[precision]


#: the shared-memory capacity of dense.cu's one-block-per-sample interaction kernels (elements of
#: T; dense_interaction.cuh): a sample whose features (rows padded to D + 1) and pair gradients fit
#: take them
TILE_ELEMENTS = 4352
TILE_PAIRS = 1024


def fits_tile(f: int, dim: int, self_interaction: bool) -> bool:
    """True when one sample of F features of ``dim`` fits the ``_tile`` kernels' shared memory."""
    return f * (dim + 1) <= TILE_ELEMENTS and _n_pairs(f, self_interaction) <= TILE_PAIRS


#: the one-block-per-sample interaction kernels where the sample fits ``fits_blocked``: the
#: forward's features as 16-byte vectors in shared memory (``_vector``: a shared load per 4
#: products of a dot) and the backward register-blocked (``_blocked``: each thread 4 rows x one
#: 16-byte group of columns, a shared load per 16 products); False: the ``_tile`` kernels (a
#: shared load per product). The same bits
BLOCKED_INTERACTION = True
#: dense.cu's oe::dense::BLOCK_ROWS: the rows of G (the pair gradients) each thread of the
#: blocked backward owns
BLOCK_ROWS = 4


def fits_blocked(f: int, dim: int, dtype=np.float32) -> bool:
    """True when the ``_vector`` forward and the ``_blocked`` backward take one sample of F
    features of ``dim`` of ``dtype``: ``dim`` a multiple of a 16-byte vector's values (4 float32,
    2 float64), and in the tile kernels' shared memory the features (F rows of dim + one vector)
    and the pair gradients (F x F rounded up to BLOCK_ROWS)."""
    lanes = 16 // np.dtype(dtype).itemsize
    rows = -(-f // BLOCK_ROWS) * BLOCK_ROWS
    return (dim % lanes == 0 and f * (dim + lanes) <= TILE_ELEMENTS
            and f * rows <= TILE_PAIRS)


def _pick_tile(tile, f, dim, self_interaction) -> bool:
    fits = fits_tile(f, dim, self_interaction)
    if tile and not fits:
        raise InputError(f"tile=True: a sample of {f} features of dim {dim} does not fit the "
                         f"shared memory of the tile kernels ({TILE_ELEMENTS} elements, "
                         f"{TILE_PAIRS} pairs); pass tile=None")
    return fits if tile is None else bool(tile)


def _n_pairs(f: int, self_interaction: bool) -> int:
    return f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2


def _float(name, a, ndim, like=None):
    if a.ndim != ndim:
        raise InputError(f"{name} has shape {tuple(a.shape)} but must have {ndim} dimensions")
    if a.dtype not in (np.float32, np.float64) or (like is not None and a.dtype != like.dtype):
        raise InputError(f"{name}.dtype={a.dtype}: use float32 (float64 for gradient checks), "
                         "the same for every input")
    if not a.flags.c_contiguous:
        raise InputError(f"{name} is not C-contiguous: pass xp.ascontiguousarray({name})")
    return a


# ---------------------------------------------------------------- bias + activation + cast


def bias_act_cast_forward(h, b, relu: bool, precision: str, launch=None, write_y: bool = True):
    """h: (B, N) GEMM output, overwritten by y; b: (N,) -> (y (B, N), mask (ceil(B N / 32),)
    uint32 bit-packed y > 0 or None, y_bits (B, N) uint16 of y in fp16 / bf16 or None).
    ``write_y=False`` (fp16 / bf16 only): y exists only as y_bits, h is left as it was and None
    is returned in y's place (a hidden output that only the next layer's GEMM reads)."""
    launch = resolve(launch)
    xp = launch.xp
    h = _float("h", h, 2)
    b = _float("b", b, 1, like=h)
    rows, cols = h.shape
    if b.shape != (cols,):
        raise InputError(f"b has shape {tuple(b.shape)}, expected ({cols},)")
    kind = _kind(precision)
    cast = kind in (1, 2)
    if not write_y and not cast:
        raise InputError(f"bias_act_cast_forward(write_y=False) under precision={precision!r}: "
                         "only fp16 / bf16 have the 16-bit copy that stands in for y")
    words = cm.mask_words(rows * cols)
    mask = xp.empty((words,), dtype=xp.uint32) if relu else xp.empty((1,), xp.uint32)
    bits = xp.empty((rows, cols), dtype=xp.uint16) if cast else xp.empty((1,), xp.uint16)
    if words:
        blocks = cm.warp_blocks(words, launch.n_sms, launch.block)
        launch.run("dense", "bias_act_cast", h.dtype, (blocks,), (launch.block,),
                   (h, b, np.int64(rows), np.int32(cols), np.int32(bool(relu)), np.int32(kind),
                    h, mask, bits, np.int32(bool(write_y)), np.int32(cm.LOADS_AHEAD)))
    return (h if write_y else None), (mask if relu else None), (bits if cast else None)


def bias_act_backward_cast(dy, mask, precision: str, launch=None, round_input: bool = False):
    """The backward of ``bias_act_cast_forward`` under fp16 / bf16, for a Linear layer's two
    backward GEMMs: dy (B, N) float32; mask: its forward's bit-packed ReLU mask or None ->
    (dh_bits (B, N) uint16, the fp16 / bf16 pattern of dh = dy * mask; db (N,), dh's column
    sums). One pass (``dense_bias_act_backward_cast``); dh itself is never written. The same
    bits as ``bias_act_backward`` then the cast of dh (``gemm.cast``), and db as its column
    sums (the same chunks, the same block sums, summed alike). ``round_input``: dy is an input
    gradient the layer above left unrounded (``Linear.backward(round_dx=False)``): each element
    is rounded to ``precision`` as it is read, so the result equals this function of the
    rounded dy, bit for bit."""
    launch = resolve(launch)
    xp = launch.xp
    dy = _float("dy", dy, 2)
    kind = _kind(precision)
    if kind not in (1, 2):
        raise InputError(f"precision={precision!r}: bias_act_backward_cast writes fp16 / bf16 "
                         "patterns; use fp16 or bf16")
    rows, cols = dy.shape
    if mask is not None and (mask.dtype != np.uint32 or mask.shape != (cm.mask_words(rows * cols),)):
        raise InputError(f"mask has shape {tuple(mask.shape)} and dtype {mask.dtype}; expected "
                         f"({cm.mask_words(rows * cols)},) uint32 from the forward of this shape")
    n_chunks, rows_per_chunk = cm.column_chunks(rows, max(cols, 1), launch.n_sms)
    bits = xp.empty((rows, cols), dtype=xp.uint16)
    partial = xp.empty((n_chunks, max(cols, 1)), dtype=dy.dtype)
    if cols:
        launch.run("dense", "bias_act_backward_cast", dy.dtype,
                   (-(-cols // 32), n_chunks), (32, cm.COLUMN_BLOCK_ROWS),
                   (dy, xp.empty((1,), xp.uint32) if mask is None else mask,
                    np.int32(mask is not None), np.int64(rows), np.int32(cols),
                    np.int64(rows_per_chunk), np.int32(kind), np.int32(bool(round_input)), bits,
                    partial, np.int32(cm.LOADS_AHEAD)))
    return bits, partial[:, :cols].sum(axis=0)


# ---------------------------------------------------------------- dot interaction


def _parts(first, rest):
    first = _float("first", first, 3)
    rest = _float("rest", rest, 3, like=first)
    if rest.shape[0] != first.shape[0] or rest.shape[2] != first.shape[2]:
        raise InputError(f"rest has shape {tuple(rest.shape)}, which does not match batch "
                         f"{first.shape[0]} and dim {first.shape[2]} of first")
    return first, rest


def interaction_forward(first, rest, concat, self_interaction: bool, pad: int, precision: str,
                        launch=None, tile: bool | None = None, bits_only: bool = False):
    """first: (B, F1, D), rest: (B, F2, D) (the features, F = F1 + F2, read in place); concat:
    (B, C) or None -> out (B, C + P + pad) = [concat | x_r . x_c over pair_table(F) | zeros].

    ``tile``: the one-block-per-sample kernel (features in shared memory) or the one-thread-per-
    output one; None picks the first where the sample fits (``fits_tile``). Same results.
    ``bits_only`` (fp16 / bf16): out is written only as its 16-bit patterns, (B, C + P + pad)
    uint16, as ``kernels.gemm.cast`` would give them (the concat columns rounded too): the
    operand of the next layer's product, which reads nothing else of it."""
    launch = resolve(launch)
    first, rest = _parts(first, rest)
    batch, f1, dim = first.shape
    return _forward(launch, first, rest, _no_bits(launch), _SPLIT, batch, f1, rest.shape[1], dim,
                    concat, self_interaction, pad, precision, tile, bits_only)


def interaction_forward_packed(features, n_first: int, concat, self_interaction: bool, pad: int,
                               precision: str, launch=None, tile: bool | None = None,
                               bits_only: bool = False):
    """``interaction_forward`` on one buffer: features (B, F, D) float32 (precision off / tf32)
    or uint16, the fp16 / bf16 patterns of the values (precision fp16 / bf16; see
    ``kernels.layout_ops``). Same results as the split call on the decoded values;
    ``n_first`` only sets where ``interaction_backward_packed`` splits the gradient."""
    launch = resolve(launch)
    data, bits, packed, _ = _packed(features, n_first, precision, launch)
    batch, f, dim = features.shape
    return _forward(launch, data, data, bits, packed, batch, int(n_first), f - int(n_first), dim,
                    concat, self_interaction, pad, precision, tile, bits_only)


_SPLIT, _PACKED, _PACKED_BITS = 0, 1, 2   # dense.cu's layouts


def _no_bits(launch):
    return launch.xp.empty((1,), dtype=launch.xp.uint16)


def _packed(features, n_first, precision, launch):
    """-> (the float buffer, or a stand-in; the bits, or a stand-in; layout; float dtype)."""
    if features.ndim != 3 or not features.flags.c_contiguous:
        raise InputError(f"features of shape {tuple(features.shape)}: pass a C-contiguous "
                         "(B, F, D) array")
    if not 0 <= int(n_first) <= features.shape[1]:
        raise InputError(f"n_first={n_first} is outside 0..{features.shape[1]} features")
    if features.dtype == np.uint16:
        if precision not in HALF_PRECISIONS:
            raise InputError(f"16-bit features under precision={precision!r}: they hold fp16 / "
                             "bf16 patterns; pass float32 features for off / tf32")
        return (launch.xp.empty((1,), dtype=np.float32), features, _PACKED_BITS,
                np.dtype(np.float32))
    features = _float("features", features, 3)
    return features, _no_bits(launch), _PACKED, features.dtype


def _forward(launch, first, rest, bits, packed, batch, f1, f2, dim, concat, self_interaction,
             pad, precision, tile, bits_only):
    xp = launch.xp
    if bits_only and precision not in HALF_PRECISIONS:
        raise InputError(f"interaction_forward(bits_only=True) under precision={precision!r}: "
                         "16-bit patterns are fp16 / bf16 values; use fp16 or bf16")
    n_concat = 0
    if concat is not None:   # first: the float features, or a float32 stand-in beside bits
        concat = _float("concat", concat, 2, like=first)
        if concat.shape[0] != batch:
            raise InputError(f"concat has {concat.shape[0]} rows but the features have batch {batch}")
        n_concat = concat.shape[1]
    if int(pad) != pad or pad < 0:
        raise InputError(f"pad={pad!r} must be an integer >= 0")
    n_pairs = _n_pairs(f1 + f2, bool(self_interaction))
    width = n_concat + n_pairs + int(pad)
    out = xp.empty((1,) if bits_only else (batch, width), dtype=first.dtype)
    out_bits = xp.empty((batch, width) if bits_only else (1,), dtype=xp.uint16)
    tile = _pick_tile(tile, f1 + f2, dim, bool(self_interaction))
    if batch * width:
        blocks = cm.grid_stride_blocks(batch * launch.block if tile else batch * width,
                                       launch.n_sms, launch.block)
        name = ("interaction_forward" if not tile else "interaction_forward_vector"
                if BLOCKED_INTERACTION and fits_blocked(f1 + f2, dim, first.dtype)
                else "interaction_forward_tile")
        launch.run("dense", name, first.dtype, (blocks,), (launch.block,),
                   (first, rest, bits, np.int32(packed), first if concat is None else concat,
                    np.int64(batch), np.int32(f1), np.int32(f2), np.int32(dim),
                    np.int32(bool(self_interaction)), np.int32(_kind(precision)),
                    np.int32(n_concat), np.int32(n_pairs), np.int32(width), out, out_bits,
                    np.int32(bool(bits_only))))
    return out_bits if bits_only else out


def interaction_backward(dout, first, rest, n_concat: int, self_interaction: bool,
                         precision: str, launch=None, tile: bool | None = None):
    """dout: (B, C + P + pad) -> (dfirst (B, F1, D), drest (B, F2, D), dconcat (B, C) or None);
    ``tile`` as in ``interaction_forward``."""
    launch = resolve(launch)
    first, rest = _parts(first, rest)
    dout = _float("dout", dout, 2, like=first)
    return _backward(launch, dout, first, rest, _no_bits(launch), _SPLIT, first.shape[0],
                     first.shape[1], rest.shape[1], first.shape[2], n_concat, self_interaction,
                     precision, tile)


def interaction_backward_packed(dout, features, n_first: int, n_concat: int,
                                self_interaction: bool, precision: str, launch=None,
                                tile: bool | None = None):
    """The gradient of ``interaction_forward_packed``: dout (B, C + P + pad) -> (dfirst
    (B, n_first, D), drest (B, F - n_first, D), dconcat (B, C) or None), float32 (the float
    type of ``features`` when they are float)."""
    launch = resolve(launch)
    data, bits, packed, dtype = _packed(features, n_first, precision, launch)
    dout = _float("dout", dout, 2)
    if dout.dtype != dtype:
        raise InputError(f"dout.dtype={dout.dtype}: use {dtype}, the features' float type")
    batch, f, dim = features.shape
    return _backward(launch, dout, data, data, bits, packed, batch, int(n_first),
                     f - int(n_first), dim, n_concat, self_interaction, precision, tile)


def _backward(launch, dout, first, rest, bits, packed, batch, f1, f2, dim, n_concat,
              self_interaction, precision, tile):
    xp = launch.xp
    dtype = dout.dtype
    n_concat = int(n_concat)
    n_pairs = _n_pairs(f1 + f2, bool(self_interaction))
    width = dout.shape[1]
    if dout.shape[0] != batch or n_concat < 0 or width < n_concat + n_pairs:
        raise InputError(f"dout has shape {tuple(dout.shape)}: expected ({batch}, >= "
                         f"{n_concat} + {n_pairs}) for n_concat={n_concat} and {f1 + f2} features")
    dfirst = xp.empty((batch, f1, dim), dtype=dtype)
    drest = xp.empty((batch, f2, dim), dtype=dtype)
    dconcat = xp.empty((batch, n_concat), dtype=dtype) if n_concat else None
    n = batch * ((f1 + f2) * dim + n_concat)
    tile = _pick_tile(tile, f1 + f2, dim, bool(self_interaction))
    if n:
        blocks = cm.grid_stride_blocks(batch * launch.block if tile else n, launch.n_sms,
                                       launch.block)
        name = ("interaction_backward" if not tile else "interaction_backward_blocked"
                if BLOCKED_INTERACTION and fits_blocked(f1 + f2, dim, dtype)
                else "interaction_backward_tile")
        launch.run("dense", name, dtype, (blocks,), (launch.block,),
                   (dout, first, rest, bits, np.int32(packed), np.int64(batch), np.int32(f1),
                    np.int32(f2), np.int32(dim), np.int32(bool(self_interaction)),
                    np.int32(_kind(precision)), np.int32(n_concat), np.int32(width), dfirst,
                    drest, dfirst if dconcat is None else dconcat))
    return dfirst, drest, dconcat


# ---------------------------------------------------------------- loss + last layer


def _last_layer(logits, labels, x, w, scale, precision, launch, has_loss):
    launch = resolve(launch)
    xp = launch.xp
    logits = _float("logits", logits, 1)
    labels = _float("labels", labels, 1, like=logits) if has_loss else logits
    x = _float("x", x, 2, like=logits)
    w = _float("w", w, 1, like=logits)
    rows, k_cols = x.shape
    if rows == 0:
        raise InputError("logits is empty: the mean loss of an empty batch is undefined")
    if logits.shape != (rows,) or labels.shape != (rows,) or w.shape != (k_cols,):
        raise InputError(f"shapes logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)}: expected (B,), (B,), (B, K), (K,)")
    n_chunks, rows_per_chunk = cm.column_chunks(rows, max(k_cols, 1), launch.n_sms)
    dz = xp.empty_like(logits)
    dx = xp.empty_like(x)
    dw_partial = xp.empty((n_chunks, max(k_cols, 1)), dtype=x.dtype)
    db_partial = xp.empty((n_chunks,), dtype=x.dtype)
    loss_partial = xp.empty((n_chunks,), dtype=np.float64)
    grid = (max(1, -(-k_cols // 32)), n_chunks)
    launch.run("dense", "bce_last_layer", x.dtype, grid, (32, cm.COLUMN_BLOCK_ROWS),
               (logits, labels, x, w, np.int64(rows), np.int32(k_cols), x.dtype.type(scale),
                np.int32(_kind(precision)), np.int32(bool(has_loss)), np.int64(rows_per_chunk),
                dz, dx, dw_partial, db_partial, loss_partial))
    return (loss_partial.sum() / rows, dz, dx, dw_partial[:, :k_cols].sum(axis=0),
            db_partial.sum())


def bce_last_layer(logits, labels, x, w, scale: float, precision: str, launch=None):
    """The mean BCE of ``logits`` (B,) against ``labels`` (B,) and the backward of the layer
    ``logits = x w + b`` (x: (B, K), w: (K,)) for the loss times ``scale`` ->
    (loss 0-d float64 device array (unscaled), dz (B,), dx (B, K), dw (K,), db 0-d)."""
    return _last_layer(logits, labels, x, w, scale, precision, launch, has_loss=True)


def last_layer_backward(dz, x, w, precision: str, launch=None):
    """The backward of a one-output layer ``z = x w + b`` alone, one pass: dz (B,), x (B, K),
    w (K,) -> (dx (B, K), dw (K,), db 0-d), rounded as nn.amp's Linear backward."""
    _, _, dx, dw, db = _last_layer(dz, None, x, w, 1.0, precision, launch, has_loss=False)
    return dx, dw, db


# ---------------------------------------------------------------- float64 references


def _r(a, precision):
    """``a`` rounded to ``precision`` (from its float32 value), as float64."""
    a32 = np.asarray(a, np.float32)
    return (a32 if precision == "off" else round_to(a32, precision)).astype(np.float64)


def _half_out(a, precision):
    return round_to(a, precision) if precision in HALF_PRECISIONS else a


def interaction_forward_reference(first, rest, concat, self_interaction, pad, precision):
    """float64 spec of ``interaction_forward`` (products of rounded operands, exact sums)."""
    from .reference import interaction_pairs

    x = np.concatenate([_r(first, precision), _r(rest, precision)], axis=1)
    rows, cols = interaction_pairs(x.shape[1], bool(self_interaction))
    z = np.einsum("bid,bjd->bij", x, x)[:, rows, cols]
    z = _half_out(z, precision)
    parts = ([np.asarray(concat, np.float64)] if concat is not None else []) + [z]
    out = np.concatenate(parts, axis=1)
    return np.pad(out, ((0, 0), (0, int(pad))))


def interaction_backward_reference(dout, first, rest, n_concat, self_interaction, precision):
    """float64 spec of ``interaction_backward``."""
    from .reference import interaction_pairs

    x = np.concatenate([_r(first, precision), _r(rest, precision)], axis=1)
    f = x.shape[1]
    rows, cols = interaction_pairs(f, bool(self_interaction))
    g = _r(np.asarray(dout)[:, n_concat:n_concat + rows.shape[0]], precision)
    dsym = np.zeros((x.shape[0], f, f))
    dsym[:, rows, cols] += g
    dsym[:, cols, rows] += g
    dx = _half_out(dsym @ x, precision)
    f1 = first.shape[1]
    return dx[:, :f1], dx[:, f1:], np.asarray(dout, np.float64)[:, :n_concat]


def bce_last_layer_reference(logits, labels, x, w, scale, precision):
    """float64 spec of ``bce_last_layer`` -> (loss, dz, dx, dw, db)."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    loss = np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))
    dz = (1.0 / (1.0 + np.exp(-z)) - y) / z.shape[0] * float(scale)
    dz_r = _r(dz, precision)
    dx = _half_out(dz_r[:, None] * _r(w, precision)[None, :], precision)
    dw = dz_r @ _r(x, precision)
    return loss, dz, dx, dw, dz.sum()
