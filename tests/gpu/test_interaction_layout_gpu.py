"""Rows gathered straight into the dot interaction's input (issue 32 item 3) on a GPU: the gather
kernel against gather + concatenation + cast, the interaction kernels on the packed buffer against
the two-part call, and DLRM training with the fused gather on and off (same losses, same rows,
bit for bit; the fused kernel ran), under amp off and bf16.

Also runs on the CPU dry run of the device path (``-p gpu_dry_run``): there the embedding's
kernels run on the emulator and the dense model on numpy; the dense kernels' test needs the GPU
(tests/unit/test_interaction_layout.py runs them on the emulator)."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.nn import amp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))
PRECISIONS = ["off", "tf32", "fp16", "bf16"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gather_into_on_the_device_equals_gather_concat_cast(precision):
    import cupy

    from one_embedding.kernels import device_ops, layout_ops

    rng = np.random.default_rng(1)
    batch, n_features, dim, n_rows = (64, 26, 128, 3000) if not DRY else (6, 5, 16, 40)
    rows = (rng.standard_normal((n_rows, dim)) * np.exp2(rng.integers(-30, 18, (n_rows, dim)))
            ).astype(np.float32)
    rows[0, :5] = [65504, 65520, 2.0 ** -25, np.inf, np.nan]
    z = rng.standard_normal((batch, dim)).astype(np.float32)
    index = rng.integers(-1, n_rows, (batch, n_features)).astype(np.int64)   # -1: padding
    rows_d, z_d, index_d = cupy.asarray(rows), cupy.asarray(z), cupy.asarray(index)
    launch = device_ops.cupy_launcher()
    target = layout_ops.empty_input(cupy, batch, n_features + 1, dim, precision, 1, launch)
    layout_ops.gather_into(rows_d, index_d, target, 1, launch)
    layout_ops.write_slot(z_d, target, 0, launch)
    # today's path: the gather kernel, the concatenation, the interaction's cast
    gathered = cupy.asnumpy(device_ops.gather_rows(rows_d, index_d, launch, check_index=False))
    stacked = np.concatenate([z[:, None], gathered], axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = amp.round_to(stacked, precision) if precision in amp.HALF_PRECISIONS else stacked
    # decoded on the host: the GPU's own fp16 -> fp32 conversion returns every NaN as 0x7fffffff,
    # numpy's keeps the payload (an H200 run: the kernel's bits were right, the decode differed)
    got = layout_ops.decode(cupy.asnumpy(target.data), precision)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    twin = layout_ops.empty_input(np, batch, n_features + 1, dim, precision, 1)
    layout_ops.gather_into(rows, index, twin, 1)
    layout_ops.write_slot(z, twin, 0)
    np.testing.assert_array_equal(cupy.asnumpy(target.data), twin.data)


@pytest.mark.skipif(DRY, reason="the dry run emulates the embedding's kernel families only; "
                                "tests/unit/test_interaction_layout.py runs dense.cu on the emulator")
@pytest.mark.parametrize("tile", [True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_interaction_on_the_buffer_equals_the_split_call_on_the_device(precision, tile):
    import cupy

    from one_embedding.kernels import dense_ops, layout_ops

    rng = np.random.default_rng(2)
    z = cupy.asarray(rng.standard_normal((300, 1, 128)).astype(np.float32))
    emb = cupy.asarray(rng.standard_normal((300, 26, 128)).astype(np.float32))
    concat = cupy.ascontiguousarray(z[:, 0])
    packed = layout_ops.encode(cupy.concatenate([z, emb], axis=1), precision)
    want = dense_ops.interaction_forward(z, emb, concat, False, 1, precision, tile=tile)
    got = dense_ops.interaction_forward_packed(packed, 1, concat, False, 1, precision, tile=tile)
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))
    dout = cupy.asarray(rng.standard_normal(want.shape).astype(np.float32))
    want_grads = dense_ops.interaction_backward(dout, z, emb, 128, False, precision, tile=tile)
    got_grads = dense_ops.interaction_backward_packed(dout, packed, 1, 128, False, precision,
                                                      tile=tile)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_array_equal(cupy.asnumpy(g), cupy.asnumpy(w))


def _train(tmp_path, precision: str, fused: bool, steps: int = 4):
    """(losses, exported keys, exported lines, dense weights, kernels launched by the embedding's
    launcher) of ``steps`` DLRM steps on the device."""
    from one_embedding.backend import to_numpy
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=128 if DRY else 4096, synthetic_rows=20_000,
                      embedding_dim=16, bottom_mlp=(32, 16), top_mlp=(64, 1), store="device_mem",
                      cache_mb=1.0, optimizer="adagrad", device="cuda", amp=precision,
                      persistent_path=str(tmp_path / f"{precision}-{fused}"))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    trainer.model.gather_into_interaction = fused
    launch = trainer.embedding.launch
    launched, run = set(), launch.run

    def recording_run(family, name, *args):
        launched.add(f"{family}_{name}")
        return run(family, name, *args)

    launch.run = recording_run            # the launcher is the device's, shared: undone below
    try:
        losses = [float(to_numpy(trainer.train_step(batch)))
                  for batch in itertools.islice(trainer.batches(), steps)]
    finally:
        del launch.run
    keys, lines = trainer.embedding.export()
    weights = [to_numpy(p.data).copy() for p in trainer.model.parameters()]
    trainer.close()
    return losses, keys, lines, weights, launched


@pytest.mark.parametrize("precision", ["off", "bf16"])
def test_dlrm_training_with_the_fused_gather_equals_the_plain_gather(tmp_path, precision):
    plain = _train(tmp_path, precision, fused=False)
    fused = _train(tmp_path, precision, fused=True)
    assert fused[0] == plain[0], (fused[0], plain[0])                 # the losses, bit for bit
    assert all(np.isfinite(plain[0]))
    np.testing.assert_array_equal(fused[1], plain[1])
    np.testing.assert_array_equal(fused[2], plain[2])                 # the rows and their state
    for f, p in zip(fused[3], plain[3]):
        np.testing.assert_array_equal(f, p)                           # the dense weights
    # 16 columns of 16-byte aligned lines of 16 + 16 (adagrad's state) float32: the gathers at
    # 16 bytes per thread (issue 32 item 3), not their scalar twins
    assert "embedding_gather_into_vector" in fused[4], fused[4]
    assert not {"embedding_gather", "embedding_gather_vector", "embedding_gather_into"} & fused[4]
    assert "embedding_gather_vector" in plain[4], plain[4]
    assert not {"embedding_gather", "embedding_gather_into", "embedding_gather_into_vector"} & plain[4]
