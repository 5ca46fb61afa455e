"""Mixed precision (AMP): the dense model's matrix products on tensor cores, the rest in fp32.

::

    with amp.autocast("fp16"):            # "tf32", "fp16" or "bf16"; "off" (the default) changes nothing
        logits = model(dense, ids)
        ...
        model.backward(dlogits * scaler.scale)

Inside ``autocast`` the products of the dense model — every Linear layer's ``x Wᵀ`` and its two
backward products, and the dot interaction (inputs and pairwise dot products) — take operands
rounded to the precision's type and accumulate in fp32:

- ``tf32``: operands rounded to TF32 (fp32's 8 exponent bits, 10 mantissa bits: what an Ampere /
  Hopper tensor core reads for an fp32 GEMM in TF32 mode); results stay fp32.
- ``fp16`` / ``bf16``: operands rounded to the half type, and results rounded to it as PyTorch's
  ``torch.autocast`` gives them, except the weight gradients ``dhᵀ x``: those are sums over the
  whole batch and leave the product in fp32 (``matmul(..., fp32_result=True)``; a half-typed C
  of the same GEMM would overflow: see below).

Everything else stays fp32: the master weights and biases, the optimizer state, the embedding
rows in the store and their optimizer state ("fp32 master rows"), bias + activation passes, DCN's
cross layers and FM's sums, the loss.

fp16 (5 exponent bits) underflows small gradients: train it with a loss scale
(``optim.LossScaler``; the Trainer does this for ``--amp fp16``). bf16 and tf32 have fp32's
exponent range and need none. Why the weight gradients keep an fp32 result: under the loss
scale's start of 2**16, the last layer's ``dhᵀ x`` (a sum of 64 (sigmoid - y) x over the
batch) passed fp16's 65504 on the second step of a DLRM run and that step was skipped; on a
10,000-row, one-epoch run (7 steps) the skip alone cost the fp16 run 0.008 AUC against fp32.

How the products run:

- CuPy: cuBLAS ``gemmEx`` / ``gemmStridedBatchedEx`` (``kernels.gemm``) with fp16 or bf16
  operands (rounded by ``kernels/cuda/dense.cu``'s cast kernel) and an fp32 accumulator and C,
  or fp32 operands under ``CUBLAS_COMPUTE_32F_FAST_TF32``: tensor cores in every mode.
- numpy: the operands rounded to the type's values (round to nearest even) and multiplied by the
  fp32 BLAS — the numbers tensor cores multiply, accumulated in fp32 — then the result rounded
  likewise where the GPU's is. It differs from the GPU only in summation order (and, for tf32,
  in how cuBLAS rounds its inputs), and gives CPU runs the numerics of a GPU run, not its speed.
"""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from ..backend import array_namespace
from ..kernels.precision import HALF_PRECISIONS, PRECISIONS, check_precision  # noqa: F401
from ..kernels.precision import from_bits as _from_bits
from ..kernels.precision import round_to as _round_to

_current = contextvars.ContextVar("one_embedding_amp", default="off")


@contextlib.contextmanager
def autocast(precision: str = "fp16"):
    """Run the dense model's products in ``precision`` ("off", "tf32", "fp16", "bf16") inside
    the block (this thread / task only; nesting restores the outer setting)."""
    token = _current.set(check_precision(precision))
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str:
    """The precision in effect here: "off", "tf32", "fp16" or "bf16"."""
    return _current.get()


def active() -> bool:
    return _current.get() != "off"


def round_to(x, precision: str | None = None):
    """``kernels.precision.round_to`` in ``precision``, by default the one in effect here."""
    return _round_to(x, current() if precision is None else precision)


def from_bits(bits, precision: str | None = None):
    """``kernels.precision.from_bits``: fp16 / bf16 patterns (uint16) -> their float32 values,
    in ``precision``, by default the one in effect here."""
    return _from_bits(bits, current() if precision is None else precision)


def matmul(a, b, *, fp32_result: bool = False, a_bits=None, b_bits=None):
    """``a @ b`` with the current precision's operands and result (see the module docstring);
    the float32 / float64 ``a @ b`` when AMP is off (on CuPy float32 operands go through
    ``kernels.gemm``, cuBLAS's fp32 product, which a CUDA graph can capture: CuPy's own
    ``matmul`` refuses to run while a stream captures). a: (..., M, K), b: (..., K, N) ->
    (..., M, N) in a's dtype (float32 or float64).

    ``fp32_result``: under fp16 / bf16 the result keeps the fp32 accumulator's value instead of
    being rounded to the half type (the weight gradients: sums over the batch that would
    overflow fp16; Linear's forward, whose fp32 result goes straight into bias + ReLU). tf32
    results are always fp32. ``a_bits`` / ``b_bits``: on CuPy under fp16 / bf16, an operand
    already cast to its 16-bit pattern (uint16, the shape of the C-contiguous operand), e.g.
    the previous layer's ``out_bits``; ignored elsewhere. Under fp16 / bf16 ``a`` or ``b`` may
    also be such a uint16 pattern itself, on numpy too (its values are exact in float32; the
    result is then float32)."""
    precision = current()
    xp = array_namespace(a, b)
    if precision == "off" and (xp is np or a.dtype != np.float32 or b.dtype != np.float32):
        return a @ b
    if xp is not np:
        from ..kernels import gemm  # imports cupy: only on the GPU path

        return gemm.matmul(a, b, "fp32" if precision == "off" else precision,
                           fp32_result=fp32_result, a_bits=a_bits,
                           b_bits=b_bits)
    # a uint16 operand is its fp16 / bf16 pattern, as on CuPy (kernels.gemm)
    a, b = (from_bits(x, precision) if x.dtype == np.uint16 else x for x in (a, b))
    product = round_to(a, precision) @ round_to(b, precision)
    if precision == "tf32" or fp32_result:
        return product
    return round_to(product, precision)
