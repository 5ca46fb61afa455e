"""Matrix products on CuPy arrays for the dense layers: cuBLAS ``gemmEx`` and
``gemmStridedBatchedEx`` with an fp32 accumulator and fp32 C, in every precision of ``nn.amp``.

- fp32 (AMP off): fp32 operands, ``CUBLAS_COMPUTE_32F``, as ``cupy.matmul`` computes them.
- tf32: fp32 operands, ``CUBLAS_COMPUTE_32F_FAST_TF32`` (the tensor cores read 10 mantissa bits).
- fp16 / bf16: the operands cast to 16-bit (``kernels/cuda/dense.cu``'s ``dense_cast``, round to
  nearest even, the bits of ``nn.amp.round_to``) and multiplied under ``CUBLAS_COMPUTE_32F``;
  the fp32 result is rounded to the half type in place unless ``fp32_result``.

CuPy 14 has no batched bf16 matmul and no bfloat16 dtype of its own: the 16-bit operands here are
uint16 arrays of the bits, handed to cuBLAS with their CUDA data type. A transposed 2-D or batched
operand (``w.T``, ``x.transpose(0, 2, 1)`` of a C-contiguous array) is read in place through the
transpose flag. float64 operands (gradient checks) are rounded and multiplied as on numpy.

While this thread captures a CUDA graph (``host_sync.capturing``, ``cuda_graph.StepGraph``) the
products are issued through ``ctypes`` on the cuBLAS library CuPy loaded: CuPy's own cuBLAS
wrappers refuse to run while a stream captures (their ``setStream`` raises NotImplementedError,
CuPy 13/14), though cuBLAS supports capture. The call is the same either way (same handle,
arguments, stream of the caller), so a captured product gives the bits of an uncaptured one.

``import cupy`` happens inside the functions only.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from .. import host_sync
from ..errors import InputError
from . import cuda_module as cm
from .precision import round_to

#: cudaDataType and cublasComputeType_t values (cuBLAS >= 11; the same in CUDA 12 and 13)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
#: dense_cast's ``kind`` codes (kernels/cuda/dense.cu)
KINDS = {"fp16": 1, "bf16": 2, "tf32": 3}
_DATA_TYPES = {"fp16": CUDA_R_16F, "bf16": CUDA_R_16BF, "tf32": CUDA_R_32F, "fp32": CUDA_R_32F}
#: precisions whose operands go to cuBLAS as they are (no 16-bit cast)
_FP32_OPERANDS = ("tf32", "fp32")


class _CapturedCublas:
    """The cuBLAS calls ``matmul`` makes, issued through ``ctypes`` on the library CuPy loaded
    (found in /proc/self/maps), with the signatures of CuPy's ``cupy.cuda.cublas`` functions of
    the same names; for use while a stream captures, where CuPy's wrappers refuse."""

    def __init__(self):
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1] if line.strip() else ""
                if "/libcublas.so" in name:
                    path = name
                    break
        if path is None:
            raise RuntimeError("no libcublas.so in this process (CuPy loads it at its first cuBLAS "
                               "call): run one matrix product before capturing a CUDA graph")
        lib = ctypes.CDLL(path)
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes, self._set_stream.restype = [p, p], i
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self._gemm.restype = i
        self._batched = lib.cublasGemmStridedBatchedEx
        self._batched.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll,
                                  i, i, i]
        self._batched.restype = i
        self.path = path

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} returned cuBLAS status {status} (while capturing a CUDA "
                               "graph)")

    def setStream(self, handle, stream_ptr):  # noqa: N802 -- cupy.cuda.cublas's name
        self._check(self._set_stream(handle, stream_ptr), "cublasSetStream")

    def gemmEx(self, *args):  # noqa: N802
        self._check(self._gemm(*args), "cublasGemmEx")

    def gemmStridedBatchedEx(self, *args):  # noqa: N802
        self._check(self._batched(*args), "cublasGemmStridedBatchedEx")


_captured_cublas: _CapturedCublas | None = None
_captured_lock = threading.Lock()


def _cublas_calls():
    """What issues ``matmul``'s cuBLAS calls: CuPy's wrappers, or while this thread captures a
    CUDA graph the ``ctypes`` ones (made once)."""
    global _captured_cublas
    if not host_sync.capture_in_progress():
        from cupy.cuda import cublas

        return cublas
    with _captured_lock:
        if _captured_cublas is None:
            _captured_cublas = _CapturedCublas()
    return _captured_cublas


def _layout(x):
    """-> (base, transposed): ``base`` C-contiguous with ``x`` == base or base's transpose over
    the last two axes."""
    import cupy

    swapped = x.swapaxes(-1, -2)
    if x.flags.c_contiguous:
        return x, False
    if swapped.flags.c_contiguous:
        return swapped, True
    return cupy.ascontiguousarray(x), False


def cast(x, precision: str, *, bits: bool = True, rounded: bool = False, launch=None):
    """C-contiguous float32 ``x`` -> (uint16 bits of its fp16 / bf16 values or None, float32
    ``x`` rounded to ``precision`` or None), one pass (``dense_cast``). tf32 gives no bits."""
    from .device_ops import resolve

    launch = resolve(launch)
    xp = launch.xp
    kind = KINDS[precision]
    want_bits = bits and kind != 3
    out_bits = xp.empty(x.shape, dtype=xp.uint16) if want_bits else xp.empty((1,), xp.uint16)
    out_rounded = xp.empty_like(x) if rounded else xp.empty((1,), x.dtype)
    n = x.size
    if n:
        blocks = cm.grid_stride_blocks(n, launch.n_sms, launch.block)
        launch.run("dense", "cast", x.dtype, (blocks,), (launch.block,),
                   (x, np.int64(n), np.int32(kind), np.int32(want_bits), out_bits,
                    np.int32(bool(rounded)), out_rounded))
    return (out_bits if want_bits else None), (out_rounded if rounded else None)


def _operand(x, precision, bits=None):
    """-> (device pointer owner, transposed, leading dim, batch stride) of one operand;
    ``bits``: x's 16-bit pattern when already cast (x C-contiguous, same shape). A uint16 ``x``
    under fp16 / bf16 is such a pattern itself (or a transposed view of one): taken as it is."""
    base, transposed = _layout(x)
    if x.dtype == np.uint16:
        pass
    elif precision not in _FP32_OPERANDS:
        usable = (bits is not None and not transposed and bits.shape == base.shape
                  and bits.dtype == np.uint16 and bits.flags.c_contiguous)
        base = bits if usable else cast(base, precision)[0]
    rows, cols = base.shape[-2:]
    stride = rows * cols if base.ndim == 3 else 0
    return base, transposed, cols, stride


def matmul(a, b, precision: str, *, fp32_result: bool = False, a_bits=None, b_bits=None):
    """``a @ b`` in ``precision`` ("fp32", "tf32", "fp16", "bf16"). a: (M, K) or (N, M, K);
    b: (K, N') or (N, K, N'), float32 cupy arrays -> float32 (..., M, N') (see the module
    docstring). ``a_bits`` / ``b_bits``: an operand's fp16 / bf16 bits when already cast (used
    when they fit, else cast here); under fp16 / bf16 an operand may also be such bits itself
    (uint16, or the transposed view of them), e.g. Linear's backward, whose dh exists only as
    bits (``dense_ops.bias_act_backward_cast``). float64 operands (gradient checks): ``a @ b``
    under fp32."""
    import cupy
    from cupy.cuda import cublas, device

    patterns = [x for x in (a, b) if x.dtype == np.uint16]
    if patterns and precision not in ("fp16", "bf16"):
        raise InputError(f"amp.matmul of a uint16 operand under {precision!r}: 16-bit patterns "
                         "are operands of fp16 / bf16 products only")
    if precision == "fp32" and (a.dtype != np.float32 or b.dtype != np.float32):
        return a @ b
    if any(x.dtype not in (np.float32, np.uint16) for x in (a, b)):
        product = round_to(a, precision) @ round_to(b, precision)
        return product if precision == "tf32" or fp32_result else round_to(product, precision)
    if a.ndim not in (2, 3) or b.ndim != a.ndim or a.shape[-1] != b.shape[-2] \
            or (a.ndim == 3 and a.shape[0] != b.shape[0]):
        raise InputError(f"amp.matmul of shapes {tuple(a.shape)} and {tuple(b.shape)}: pass two "
                         "2-D matrices or two 3-D batches with matching batch and inner sizes")
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[0] if a.ndim == 3 else 1
    out = cupy.empty(a.shape[:-2] + (m, n), dtype=cupy.float32)
    if out.size == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    a_base, a_t, lda, stride_a = _operand(a, precision, a_bits)
    b_base, b_t, ldb, stride_b = _operand(b, precision, b_bits)
    data_type = _DATA_TYPES[precision]
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if precision == "tf32" else CUBLAS_COMPUTE_32F
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = device.get_cublas_handle()
    calls = _cublas_calls()
    # on the current stream (the prefetch thread's work has its own), as cupy.matmul does
    calls.setStream(handle, cupy.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))
    try:
        # column-major cuBLAS: Cᵀ (n, m) = Bᵀ Aᵀ, with each row-major operand read as its
        # column-major transpose (and a transposed view as the matrix itself, flag T)
        op_b = CUBLAS_OP_T if b_t else CUBLAS_OP_N
        op_a = CUBLAS_OP_T if a_t else CUBLAS_OP_N
        if batch == 1 and a.ndim == 2:
            calls.gemmEx(handle, op_b, op_a, n, m, k, one.ctypes.data,
                          b_base.data.ptr, data_type, ldb, a_base.data.ptr, data_type, lda,
                          zero.ctypes.data, out.data.ptr, CUDA_R_32F, n, compute,
                          CUBLAS_GEMM_DEFAULT)
        else:
            calls.gemmStridedBatchedEx(
                handle, op_b, op_a, n, m, k, one.ctypes.data,
                b_base.data.ptr, data_type, ldb, stride_b, a_base.data.ptr, data_type, lda,
                stride_a, zero.ctypes.data, out.data.ptr, CUDA_R_32F, n, m * n, batch, compute,
                CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    if precision in _FP32_OPERANDS or fp32_result:
        return out
    _, rounded = cast(out, precision, bits=False, rounded=True)
    return rounded
