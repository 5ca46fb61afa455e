"""Data on a GPU: the CUDA synthetic generator against the CPU generator, bit for bit, and the
staging of file batches through page-locked buffers on their own stream.

Needs CuPy and a CUDA device (skipped without). On a machine without a GPU the dry run runs the
same tests on numpy and the kernel emulator:

    PYTHONPATH=tests python -m pytest -p gpu_dry_run -m gpu tests/gpu/test_data_device_gpu.py
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from one_embedding.backend import cupy_available
from one_embedding.data import BatchLoader, SyntheticCriteo, write_parquet
from one_embedding.data.device import DeviceBatches, DeviceSynthetic, DeviceSyntheticLoader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY_RUN = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"
#: rows per comparison: a GPU generates millions in milliseconds; the emulator runs one thread
#: at a time
ROWS = 3000 if DRY_RUN else 1_000_000


@pytest.fixture(scope="module")
def launcher(request):
    """The CuPy launcher; in a dry run the emulator built with the data kernels."""
    from one_embedding.kernels import device_ops

    if not DRY_RUN:
        return device_ops.cupy_launcher()
    from cuda_emulation import EmulatedLauncher, build

    from one_embedding.kernels import cuda_module as cm

    folder = Path(request.config.rootpath) / ".pytest_cache" / "cuda_emulation"
    return EmulatedLauncher(build(cm.DATA_FAMILIES, folder), cm.DATA_FAMILIES)


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


@pytest.mark.parametrize("kwargs", [dict(cardinalities="kaggle", scale=0.01, seed=3),
                                    dict(cardinalities="mlperf40m", scale=0.05, seed=4),
                                    dict(cardinalities=[3, 5, 17, 9000], alpha=1.0, seed=2)],
                         ids=["cli-default", "mlperf-tails", "alpha-1"])
def test_device_rows_equal_the_cpu_generator_bit_for_bit(kwargs, launcher):
    src = SyntheticCriteo(**kwargs)
    device = DeviceSynthetic(src, launcher)
    for start in (0, 10**12 + 7):
        got = [_host(a) for a in device.rows(start, ROWS)]
        want = src.generate(start, ROWS)
        for name, g, w in zip(("dense", "ids", "labels", "logits"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert g.tobytes() == w.tobytes(), f"{name}: {(g != w).sum()} of {g.size} differ"


def test_device_loader_yields_the_cpu_loaders_batches(launcher):
    src = SyntheticCriteo("kaggle", scale=0.01, seed=7, num_rows=4 * ROWS, block_rows=4096)
    size = ROWS // 4
    loader = BatchLoader(src, size, split="train", drop_last=True, read_ahead=0)
    loader.set_epoch(0, start_batch=2)
    want = list(loader)
    got = list(DeviceSyntheticLoader(loader, launcher))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        for k in ("dense", "ids", "labels"):
            assert _host(getattr(g, k)).tobytes() == getattr(w, k).tobytes()


def test_parquet_batches_arrive_on_the_device_through_pinned_buffers(tmp_path):
    from one_embedding.kernels import device_ops

    src = SyntheticCriteo("kaggle", scale=0.01, seed=1)
    path = tmp_path / "d.parquet"
    write_parquet(path, [src.rows(lo, 20_000).batch() for lo in range(0, 100_000, 20_000)])
    want = list(BatchLoader([path], 8192, read_ahead=0))
    staged = DeviceBatches(BatchLoader([path], 8192), device_ops.cupy_launcher(), depth=3)
    got = list(staged)
    assert len(got) == len(want) == 13
    for g, w in zip(got, want):
        assert isinstance(g.ids, device_ops.cupy_launcher().xp.ndarray)
        for k in ("dense", "ids", "labels"):
            assert _host(getattr(g, k)).tobytes() == getattr(w, k).tobytes()


@pytest.mark.parametrize("source", ["synthetic", "parquet"])
def test_the_trainer_on_cuda_reads_its_batches_through_the_device_feed(source, tmp_path):
    """``train --device cuda`` generates synthetic rows on the device and stages file batches
    through DeviceBatches: the feed is the device one, and its run ends where the CPU run does
    (in a dry run within 1e-6: the device step fuses the loss with the last layer's backward,
    whose batch sums run in blocks; on a GPU cuBLAS sums in another order too: within 1e-3)."""
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    data = ("synthetic",)
    if source == "parquet":
        rows = SyntheticCriteo("kaggle", scale=0.001, seed=3, num_rows=600)
        path = tmp_path / "rows.parquet"
        write_parquet(str(path), [rows.batch(600, 0)])
        data = (str(path),)
    results = {}
    for device in ("cpu", "cuda"):
        cfg = TrainConfig(data=data, synthetic_scale=0.001, synthetic_rows=4000, batch_size=64,
                          steps=6, eval_batches=1, device=device)
        trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
        feed = type(trainer.device_feed()).__name__
        results[device] = trainer.run()
        if device == "cuda":
            assert feed == ("DeviceSyntheticLoader" if source == "synthetic" else "DeviceBatches")
    cpu, gpu = results["cpu"], results["cuda"]
    tol = 1e-6 if DRY_RUN else 1e-3
    assert abs(cpu["logloss"] - gpu["logloss"]) <= tol * abs(cpu["logloss"])
