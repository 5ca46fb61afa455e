"""TorchEmbedding over an embedding on the GPU: CUDA tensors in and out through DLPack, equal to
the CPU embedding through TorchEmbedding within 1e-6 (initial values may differ by a float32 ulp:
CUDA's float64 log1p / cos; everything else is the same arithmetic)."""
from __future__ import annotations

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.backend import cupy_available

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available() or not torch.cuda.is_available(),
                       reason="needs CuPy, a CUDA build of torch and a CUDA device"),
]

V, E = 60, 4


def one_step(device, tensor_device):
    from one_embedding.torch import TorchEmbedding

    store = oe.make_device_mem_store_options(None, capacity=V)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, None, store, device=device)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    lookup = TorchEmbedding(emb)
    out = lookup((torch.arange(12).reshape(4, 3) % 7).to(tensor_device))
    (out * out).sum().backward()
    opt.step()
    rows = lookup(torch.arange(8).to(tensor_device))
    result = out.detach().cpu().numpy().copy(), rows.detach().cpu().numpy().copy(), out.device
    emb.close()
    return result


@pytest.mark.parametrize("ids_on", ["cuda", "cpu"])
def test_cuda_tensors_through_a_gpu_embedding_equal_the_cpu_path(ids_on):
    want_out, want_rows, _ = one_step(None, "cpu")
    got_out, got_rows, device = one_step("cuda", ids_on)
    assert device.type == "cuda"  # rows of a GPU embedding come back as CUDA tensors
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_rows, want_rows, rtol=0, atol=1e-6)


def test_cuda_output_shares_the_embeddings_device_memory():
    import cupy

    from one_embedding.torch import TorchEmbedding

    store = oe.make_device_mem_store_options(None, capacity=V)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, None, store, device="cuda")
    seen = {}
    embed = emb.embed

    def spy(state):
        seen["rows"] = embed(state)
        return seen["rows"]

    emb.embed = spy
    out = TorchEmbedding(emb)(torch.arange(6, device="cuda").reshape(2, 3))
    assert isinstance(seen["rows"], cupy.ndarray)
    assert out.data_ptr() == seen["rows"].data.ptr  # zero-copy through DLPack
    emb.close()
