"""Mixed precision on CuPy: fp16 and bf16 products are cuBLAS gemmEx calls on tensor cores
(16-bit operands from dense.cu's cast, fp32 accumulation; kernels/gemm.py), against the numpy
emulation, which differs only in summation order: within one unit of the half type (2^-10 fp16,
2^-7 bf16). tests/gpu/test_dense_amp_gpu.py covers tf32 and the fused kernels."""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.nn import Linear, amp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

ULP = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_rounding_on_the_device_equals_numpy(precision):
    import cupy

    x = (np.random.default_rng(0).standard_normal(100_000) * 300).astype(np.float32)
    got = cupy.asnumpy(amp.round_to(cupy.asarray(x), precision))
    np.testing.assert_array_equal(got, amp.round_to(x, precision))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_device_products_equal_the_emulation_within_a_half_unit(precision):
    import cupy

    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 256)).astype(np.float32)
    with amp.autocast(precision):
        want = amp.matmul(a, b)
        got = cupy.asnumpy(amp.matmul(cupy.asarray(a), cupy.asarray(b)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(amp.round_to(got, precision), got)
    assert np.all(np.abs(got - want) <= 2 * ULP[precision] * np.abs(want) + 1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_linear_layer_on_the_device_equals_numpy(precision):
    import cupy

    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    dy = rng.standard_normal((256, 128)).astype(np.float32)
    host, device = Linear(512, 128, relu=True, seed=3), Linear(512, 128, relu=True, seed=3)
    device.to(cupy)
    with amp.autocast(precision):
        y, dx = host(x), host.backward(dy)
        y_d = cupy.asnumpy(device(cupy.asarray(x)))
        dx_d = cupy.asnumpy(device.backward(cupy.asarray(dy)))
    tol = 2 * ULP[precision]

    def mostly_close(got, want, atol):
        """All but a few elements within tolerance: a product within one unit of zero may round
        to the other side on the two devices, flipping one ReLU mask element (and the gradient
        rows it feeds)."""
        ok = np.abs(got - want) <= tol * np.abs(want) + atol
        assert ok.mean() > 0.995, (ok.mean(), np.abs(got - want).max())

    mostly_close(y_d, y, 1e-3)
    mostly_close(dx_d, dx, 1e-3)
    mostly_close(cupy.asnumpy(device.weight.grad), host.weight.grad, 1e-2)
