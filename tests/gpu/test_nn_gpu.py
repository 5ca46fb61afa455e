"""The same layers and models on numpy (reference kernels) and on CuPy (CUDA kernels).

Differential tests: one body, run on both backends with the same parameters and inputs; results
agree within 1e-5 relative (fp32, no TF32), dropout masks bit for bit. Skipped without a GPU.
"""
import os

import numpy as np
import pytest

from one_embedding import nn
from one_embedding.backend import cupy_available
from one_embedding.models import DCN, DLRM, DeepFM

from helpers import close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

TOL = 1e-5
DRY = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"


def both(make, inputs, grad_shape_of_out=True):
    """Build the layer twice (same seed), run forward+backward on numpy and on cupy, compare."""
    import cupy

    cpu, gpu = make(), make().to(cupy)
    out_c = cpu(*inputs)
    out_g = gpu(*[cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in inputs])
    close(out_g, out_c)
    g = np.random.default_rng(9).standard_normal(out_c.shape).astype(out_c.dtype)
    gi_c = cpu.backward(g)
    gi_g = gpu.backward(cupy.asarray(g))
    for a, b in zip(gi_g if isinstance(gi_g, tuple) else (gi_g,), gi_c if isinstance(gi_c, tuple) else (gi_c,)):
        if b is not None:
            close(a, b)
    for pg, pc in zip(gpu.parameters(), cpu.parameters()):
        close(pg.grad, pc.grad)
        # the parameters moved to the device (a dry run's stand-in cupy keeps numpy arrays)
        assert DRY or type(pg.data).__module__.startswith("cupy")


def rnd(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("last_relu", [True, False])
def test_mlp(last_relu):
    both(lambda: nn.MLP(13, [512, 256, 128], last_relu=last_relu, seed=1), [rnd(64, 13)])


def test_mlp_dropout_same_mask():
    both(lambda: nn.MLP(20, [64, 64, 1], last_relu=False, dropout=0.3, seed=2), [rnd(33, 20)])


@pytest.mark.parametrize("self_interaction,pad", [(False, 1), (True, 0)])
def test_interaction(self_interaction, pad):
    both(lambda: nn.DotInteraction(self_interaction=self_interaction, output_padding=pad),
         [rnd(32, 27, 128), rnd(32, 128)])


@pytest.mark.parametrize("kind", ["vector", "matrix"])
def test_cross(kind):
    both(lambda: nn.CrossNet(64, 3, kind=kind, seed=3), [rnd(40, 64)])


def test_fm():
    both(lambda: nn.FM(), [rnd(40, 39, 16)])


@pytest.mark.parametrize("cls,kw", [
    (DLRM, dict(dense_features=13, embedding_dim=16, num_tables=5, bottom_mlp=[32, 16], top_mlp=[64, 1],
                table_sizes=[10] * 5)),
    (DCN, dict(num_tables=5, embedding_dim=8, dense_features=3, dnn=[32, 32], cross="matrix")),
    (DeepFM, dict(num_tables=5, embedding_dim=8, dense_features=3, dnn=[32, 32])),
])
def test_model_dense_part(cls, kw):
    import cupy

    cpu, gpu = cls(seed=1, **kw), cls(seed=1, **kw).to(cupy)
    b = 48
    dense = rnd(b, cpu.dense_features)
    emb = rnd(b, cpu.num_tables, cpu.embedding_width) * 0.3
    close(gpu.forward_from_embeddings(cupy.asarray(dense), cupy.asarray(emb)),
          cpu.forward_from_embeddings(dense, emb))
    g = rnd(b)
    dd_g, de_g = gpu.backward_to_embeddings(cupy.asarray(g))
    dd_c, de_c = cpu.backward_to_embeddings(g)
    close(de_g, de_c)
    close(dd_g, dd_c)
    for pg, pc in zip(gpu.parameters(), cpu.parameters()):
        close(pg.grad, pc.grad)
